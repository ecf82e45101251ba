"""``torch_npu.optim`` (simulated): ``NpuFusedAdamW``, stepping every parameter with ``npu_apply_adam_w``.

Huawei's ``NpuFusedAdamW`` flattens each group's parameters and states into combined buffers and updates them
with torch ops; this one calls the vendor kernel per parameter. Both follow ``torch.optim.AdamW``'s arithmetic:
decoupled weight decay and bias correction ``1 - beta**step`` (the kernel takes ``beta**(step-1)`` and multiplies
by beta once more). Not Huawei's code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torch_npu._ops import npu_apply_adam_w

__all__ = ["NpuFusedAdamW"]


class NpuFusedAdamW(torch.optim.Optimizer):
    """AdamW on NPU tensors (``torch_npu.optim.NpuFusedAdamW(params, lr, betas, eps, weight_decay, amsgrad)``).

    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq``
    (the running maximum, kept here because the kernel reads ``max_grad_norm`` but does not write it)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": amsgrad})

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            amsgrad = group["amsgrad"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("NpuFusedAdamW does not support sparse gradients, please consider SparseAdam "
                                       "instead")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                maximum = state.get("max_exp_avg_sq") if amsgrad else None
                npu_apply_adam_w(beta1 ** (t - 1), beta2 ** (t - 1), group["lr"], group["weight_decay"], beta1, beta2,
                                 group["eps"], p.grad, maximum, amsgrad, False, out=(p, exp_avg, exp_avg_sq))
                if maximum is not None:
                    torch.maximum(maximum, exp_avg_sq, out=maximum)
        return loss
