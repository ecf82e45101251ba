"""Megatron's fused Adam on the device's ``fused_adamw`` kernel.

On CUDA, megatron-core's optimizer is TransformerEngine's or apex's ``FusedAdam`` (one multi-tensor kernel per
step). Without them (always, off CUDA) it falls back to ``torch.optim.AdamW``, whose default on a non-CUDA device
is a Python loop of about ten aten calls per parameter. :func:`device_fused_adam` gives Megatron a ``FusedAdam``
that takes apex's constructor arguments and runs the plugin's ``device.optimizer.fused_adamw`` instead.

It is a ``torch.optim.Adam`` in every other respect: the same param-group options and per-parameter state
(``step`` as a 0-dim fp32 tensor, ``exp_avg``, ``exp_avg_sq``), so Megatron's checkpoints, its distributed
optimizer and devshim's own ``distributed-optimizer-*`` patches treat it as the torch optimizer it replaces, and a
state dict loads into either. A step the kernel cannot serve (amsgrad, maximize, capturable, differentiable,
tensor hyper-parameters, sparse gradients) runs torch's own ``Adam.step``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from devshim_core.errors import ConfigError
from devshim_core.integrations.megatron.flavor import ImportedMegatronCore
from devshim_core.patching import Patch, SetAttribute, SetAttributes

if TYPE_CHECKING:
    from devshim_core.device import Device
    from devshim_core.records import FusedAdamW

# keyword arguments of TransformerEngine's FusedAdam that Megatron passes with use_precision_aware_optimizer
_PRECISION_AWARE = ("exp_avg_dtype", "exp_avg_sq_dtype", "master_weights", "use_decoupled_grad",
                    "master_weight_dtype", "store_param_remainders")
_TORCH_ONLY = ("amsgrad", "maximize", "capturable", "differentiable")
OPTIMIZER = "megatron.core.optimizer"
# torch >= 2.7: one Adam class serves both modes (AdamW is Adam with decoupled_weight_decay=True), as apex's does
TORCH_ADAM_DECOUPLES = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters
# before 0.16 the distributed optimizer accepts only its own module's Adam (torch's AdamW here) by isinstance
DISTRIBUTED_ADAM_CHECK = ImportedMegatronCore(spec=">=0.12.1,<0.16", gate=True)


def optimizer_patches(device: Device) -> list[Patch]:
    """The fused-Adam patch, or none when the plugin has no ``fused_adamw`` or torch's Adam cannot run in AdamW
    mode (torch < 2.7): Megatron then keeps torch's AdamW."""
    fused = device_fused_adam(device)
    if fused is None or not TORCH_ADAM_DECOUPLES:
        return []
    return [SetAttributes(
        name="fused-adam", target=OPTIMIZER, names=("Adam", "USING_PYTORCH_OPTIMIZER"),
        make=lambda originals, d: {"Adam": fused, "USING_PYTORCH_OPTIMIZER": False},
        reason="optimizer='adam' builds the FusedAdam Megatron takes from TE or apex on CUDA, on the device's "
               "fused_adamw kernel, instead of torch's AdamW (a per-parameter loop off CUDA); its state is "
               "torch's Adam state, so checkpoints and the distributed optimizer are unchanged"),
            SetAttribute(
        name="distributed-optimizer-takes-fused-adam", target=f"{OPTIMIZER}.distrib_optimizer:Adam",
        make=lambda original, d: (original, _KernelAdam), requires=(DISTRIBUTED_ADAM_CHECK,),
        reason="megatron-core 0.12's DistributedOptimizer asserts its optimizer is an instance of the Adam its own "
               "module imported (torch's AdamW without TE or apex); devshim's FusedAdam is accepted too (the name "
               "is read only by that isinstance check)")]


def device_fused_adam(device: Device) -> type[torch.optim.Adam] | None:
    """A ``FusedAdam`` class on ``device.optimizer.fused_adamw``, or ``None`` when the plugin has no such kernel."""
    kernel = device.optimizer.fused_adamw
    if kernel is None:
        return None

    class FusedAdam(_KernelAdam):
        __doc__ = (f"apex's ``FusedAdam`` signature on devshim's {device.plugin} plugin "
                   f"(``device.optimizer.fused_adamw``); otherwise a ``torch.optim.Adam``.")
        _kernel = staticmethod(cast("FusedAdamW", kernel))  # not None (above): mypy does not carry it in here

    FusedAdam.__qualname__ = FusedAdam.__name__
    return FusedAdam


class _KernelAdam(torch.optim.Adam):
    _kernel: FusedAdamW

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, **kwargs: Any) -> None:
        refused = sorted(k for k in kwargs if k in _PRECISION_AWARE)
        if refused:
            raise ConfigError(f"use_precision_aware_optimizer ({', '.join(refused)}) needs TransformerEngine's "
                              "FusedAdam, which is CUDA-only: turn it off (Megatron-LM: drop "
                              "--use-precision-aware-optimizer).")
        if not bias_correction:  # apex's option; torch's Adam always corrects, and so must its state dict
            raise ConfigError("FusedAdam(bias_correction=False) is not served off CUDA: devshim's FusedAdam keeps "
                              "torch.optim.Adam's semantics, which always apply bias correction.")
        kwargs.pop("set_grad_none", None)  # apex's; zero_grad(set_to_none=...) says the same
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode, **kwargs)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not all(_served(group) for group in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        # the kernel takes one step number per call: parameters loaded from a checkpoint may differ
        by_step: dict[int, tuple[list[torch.Tensor], ...]] = {}
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients")
            state = self.state[param]
            if "step" not in state:  # as torch's Adam._init_group; Megatron's init_state_fn may have set the rest
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["step"] += 1
            lists = by_step.setdefault(int(state["step"].item()), ([], [], [], []))
            for target, tensor in zip(lists, (param, param.grad, state["exp_avg"], state["exp_avg_sq"]), strict=True):
                target.append(tensor)
        beta1, beta2 = group["betas"]
        for step, (params, grads, exp_avgs, exp_avg_sqs) in by_step.items():
            self._kernel(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                         eps=group["eps"], weight_decay=group["weight_decay"],
                         adamw_mode=group["decoupled_weight_decay"], bias_correction=True)


def _served(group: dict[str, Any]) -> bool:
    """Whether the kernel computes what torch's Adam would for this group (else torch's own step runs)."""
    scalars = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
    return not any(group.get(k) for k in _TORCH_ONLY) and not any(torch.is_tensor(v) for v in scalars)
