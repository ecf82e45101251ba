"""Python objects with the API of DeepSpeed's compiled ``fused_adam`` and ``cpu_adam`` modules.

``DeepSpeedCPUAdam`` and ``FusedAdam`` users (and ZeRO-Offload) call these functions directly, so the
signatures, return codes and per-optimizer state follow the compiled modules exactly; the arithmetic is
the selected plugin's kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from devshim_core.errors import KernelCallError
from devshim_core.records import FusedAdamW, HostAdamStep

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COPY_DTYPES = (torch.bfloat16, torch.float16)


class FusedAdamOp:
    """The ``fused_adam`` module API: ``multi_tensor_adam`` over [grads, params, exp_avgs, exp_avg_sqs]."""

    def __init__(self, kernel: FusedAdamW) -> None:
        self._kernel = kernel

    def multi_tensor_adam(self, chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                          lr: float, beta1: float, beta2: float, epsilon: float, step: int, adam_w_mode: int,
                          bias_correction: int, weight_decay: float, *args: Any) -> None:
        grads, params, exp_avgs, exp_avg_sqs = tensor_lists
        if not params:
            return
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
            if not p.numel() == g.numel() == m.numel() == v.numel():
                raise KernelCallError(f"fused Adam: params ({p.numel()}), grads ({g.numel()}), exp_avg ({m.numel()}) "
                                      f"and exp_avg_sq ({v.numel()}) differ in size", p)
        try:
            self._kernel(params, grads, exp_avgs, exp_avg_sqs, step=int(step), lr=lr, beta1=beta1, beta2=beta2,
                         eps=epsilon, weight_decay=weight_decay, adamw_mode=bool(adam_w_mode),
                         bias_correction=bool(bias_correction))
        except (RuntimeError, ValueError, TypeError) as error:
            raise KernelCallError(f"fused Adam kernel failed: {error}", params[0]) from error


class HostAdamOp:
    """The ``cpu_adam`` module API: ``create_adam``, ``adam_update``, ``adam_rollback``, ``destroy_adam``.

    The optimizer's AdamW/Adam mode is fixed at ``create_adam``. Unlike the compiled op, bad input raises
    :class:`KernelCallError` (holding the params tensor) instead of printing and returning -1:
    ``DeepSpeedCPUAdam.step`` discards the return code, so -1 froze a parameter group in silence.

    ``param_copies`` maps a params tensor's ``data_ptr()`` to a host bf16/fp16 tensor of its size: ``adam_update``
    of those params also writes the updated params, converted, into it in the same pass (ZeRO-Offload's one-pass
    step sets it for the length of a step), adds ``(copy, params)`` data pointers to ``copies_written`` and counts
    the copy in ``copies_made``.
    """

    def __init__(self, step: HostAdamStep, rollback: HostAdamStep | None) -> None:
        self._step = step
        self._rollback = rollback
        self._adamw_mode: dict[int, bool] = {}  # per optimizer id, fixed at create_adam
        self.param_copies: dict[int, torch.Tensor] = {}
        self.copies_written: set[tuple[int, int]] = set()
        self.copies_made = 0

    def create_adam(self, optimizer_id: int, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                    eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                    should_log: bool = False) -> int:
        self._adamw_mode[optimizer_id] = bool(adamw_mode)
        if should_log:
            mode = "AdamW" if adamw_mode else "Adam"
            print(f"Adam Optimizer #{optimizer_id} is created with devshim host kernels ({mode}); "
                  f"lr={lr}, betas=({beta1}, {beta2}), weight_decay={weight_decay}")
        return 0

    def _run(self, kernel: HostAdamStep | None, what: str, optimizer_id: int, step: int, lr: float, beta1: float,
             beta2: float, eps: float, weight_decay: float, bias_correction: bool, params: torch.Tensor,
             grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        adamw_mode = self._adamw_mode.get(optimizer_id)
        problem = None
        if adamw_mode is None:
            problem = f"optimizer #{optimizer_id} was not created (call create_adam first)"
        elif kernel is None:
            problem = f"the selected devshim plugin provides no host Adam {what} kernel"
        elif params.dtype not in _DTYPES or exp_avg.dtype not in _DTYPES or exp_avg_sq.dtype != exp_avg.dtype:
            problem = (f"unsupported dtypes params={params.dtype}, exp_avg={exp_avg.dtype}, "
                       f"exp_avg_sq={exp_avg_sq.dtype}")
        elif grads.dtype != params.dtype or params.numel() != grads.numel() or exp_avg.numel() != params.numel() \
                or exp_avg_sq.numel() != params.numel():
            problem = "params, grads and states must have the same size, and grads the params' dtype"
        if problem is not None:
            raise KernelCallError(f"host Adam {what} for optimizer #{optimizer_id}: {problem}", params)
        assert adamw_mode is not None and kernel is not None
        copy = self._param_copy(params) if kernel is self._step else None
        extra = {} if copy is None else {"param_copy": copy}
        kernel(params, grads, exp_avg, exp_avg_sq, step=int(step), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bool(bias_correction), **extra)
        if copy is not None:
            self.copies_written.add((copy.data_ptr(), params.data_ptr()))
            self.copies_made += 1
        return 0

    def _param_copy(self, params: torch.Tensor) -> torch.Tensor | None:
        copy = self.param_copies.get(params.data_ptr())
        if (copy is None or params.dtype != torch.float32 or copy.dtype not in _COPY_DTYPES
                or copy.device.type != "cpu" or copy.numel() != params.numel() or not copy.is_contiguous()):
            return None
        return copy

    def adam_update(self, optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, bias_correction: bool, params: torch.Tensor, grads: torch.Tensor,
                    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        return self._run(self._step, "update", optimizer_id, step, lr, beta1, beta2, eps, weight_decay,
                         bias_correction, params, grads, exp_avg, exp_avg_sq)

    def adam_rollback(self, optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, bias_correction: bool, params: torch.Tensor, grads: torch.Tensor,
                      exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        return self._run(self._rollback, "rollback", optimizer_id, step, lr, beta1, beta2, eps, weight_decay,
                         bias_correction, params, grads, exp_avg, exp_avg_sq)

    def destroy_adam(self, optimizer_id: int) -> int:
        self._adamw_mode.pop(optimizer_id, None)
        return 0


class PackbitsOp:
    """The ``packbits`` module API of 1-bit Adam/0/1 Adam/1-bit LAMB's compressed all-reduce
    (``deepspeed.runtime.comm.compressed``): the signs of a float tensor, 8 to a byte, most significant bit first,
    a bit set for ``x >= 0`` (the sign convention of that all-reduce's error feedback, which counts 0 and -0.0 as
    +1). Plain torch ops on the tensor's own device: nothing to compile."""

    def packbits(self, tensor: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
        bits = (tensor.reshape(-1)[:numel] >= 0).to(torch.uint8)
        if numel % 8:
            bits = torch.cat([bits, bits.new_zeros(8 - numel % 8)])
        weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=tensor.device)
        return (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8)

    def unpackbits(self, packed: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
        """``numel`` bytes of ``packed`` (uint8 or int8) as ``8 * numel`` floats of +1.0 and -1.0."""
        shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=packed.device)
        bits = (packed.reshape(-1)[:numel].to(torch.int32).unsqueeze(1) >> shifts) & 1
        return (bits.to(torch.float32) * 2 - 1).reshape(-1)
