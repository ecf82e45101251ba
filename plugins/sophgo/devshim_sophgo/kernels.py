"""The Sophgo plugin's kernels: devshim's PyTorch conventions (``devshim_core.records``) on Sophgo's ``torch_tpu``.

Imported only once the plugin is selected (Sophgo's ``torch_tpu`` identified and imported). Sophgo's fused ops
are out-parameter kernels (``torch.ops.my_ops``): rms_norm runs on ``rmsnorm_forward``/``rmsnorm_backward``
wrapped in an autograd Function, as Sophgo's own ``RMSNormFunc``. Sophgo has no standalone attention, swiglu or
rotary op (its ``llama_attention_forward`` fuses rotary and takes additive masks over packed sequences only),
so those are ``devshim_kernels``'. The fused Adam is PyTorch's ``_fused_adamw_`` — what Sophgo's
``torch.optim.AdamW(fused=True)`` runs on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import devshim_kernels as dk
import torch

from devshim_core import FusedKernels, OptimizerKernels, host_defaults

Tensor = torch.Tensor
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class _RMSNorm(torch.autograd.Function):
    """``my_ops.rmsnorm_forward`` / ``my_ops.rmsnorm_backward`` over the last dimension (Sophgo's pattern)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.ops.my_ops.rmsnorm_forward(x, weight, None, out, x.dim() - 1, eps)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
        scratch = torch.empty_like(x)  # the vendor's `rms` buffer (its wrapper allocates it full-size too)
        torch.ops.my_ops.rmsnorm_backward(grad.contiguous(), x, weight, None, scratch, grad_x, grad_w, None,
                                          x.dim() - 1, ctx.eps)
        return grad_x, grad_w, None


def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """``my_ops.rmsnorm_forward`` into a fresh output, differentiable in ``x`` and ``weight``; devshim's kernel
    where the result dtype would differ from devshim's convention (``weight`` of another dtype)."""
    if (x.dtype not in _FLOATS or x.dim() == 0 or (weight is not None and (weight.dtype != x.dtype
                                                                           or weight.shape != x.shape[-1:]))):
        return dk.rms_norm(x, weight, eps)
    return _RMSNorm.apply(x.contiguous(), weight, eps)


def _fusable(tensors: Sequence[Tensor | None]) -> bool:
    first = tensors[0]
    assert first is not None
    return first.dtype in _FUSED_DTYPES and all(
        t is None or (t.dtype == first.dtype and t.device == first.device and t.shape == first.shape
                      and t.is_contiguous()) for t in tensors)


def fused_adamw(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, adamw_mode: bool = True, bias_correction: bool = True,
                max_exp_avg_sqs: Sequence[Tensor] | None = None,
                param_copies: Sequence[Tensor | None] | None = None) -> None:
    """PyTorch's fused multi-tensor kernel (``torch._fused_adamw_``, or ``_fused_adam_`` for L2 Adam) per
    (device, dtype) group; ``devshim_kernels.fused_adamw`` for what it cannot serve: no bias correction, mixed
    dtypes (e.g. bf16 grads on fp32 params), non-contiguous tensors."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (the number of this update), got {step}")
    amsgrad = max_exp_avg_sqs is not None
    maxima: list[Tensor | None] = list(max_exp_avg_sqs) if max_exp_avg_sqs is not None else [None] * len(params)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    rest: list[int] = []
    for i, entry in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, maxima, strict=True)):
        if bias_correction and _fusable(entry):
            groups.setdefault((entry[0].device, entry[0].dtype), []).append(i)
        else:
            rest.append(i)
    kernel = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    with torch.no_grad():
        for (device, _), idx in groups.items():
            step_t = torch.tensor(float(step), dtype=torch.float32, device=device)  # fp32: int64 is not on the TPU
            kernel([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                   [exp_avg_sqs[i] for i in idx],
                   cast("list[Tensor]", [maxima[i] for i in idx]) if amsgrad else [],  # tensors where amsgrad
                   [step_t] * len(idx),
                   lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
                   maximize=False)
            for i in idx:
                copy = param_copies[i] if param_copies is not None else None
                if copy is not None:
                    copy.copy_(params[i])
    if rest:
        dk.fused_adamw([params[i] for i in rest], [grads[i] for i in rest], [exp_avgs[i] for i in rest],
                       [exp_avg_sqs[i] for i in rest], step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
                       max_exp_avg_sqs=cast("list[Tensor]", [maxima[i] for i in rest]) if amsgrad else None,  # as above
                       param_copies=None if param_copies is None else [param_copies[i] for i in rest])


def attention_kernels() -> FusedKernels:
    return FusedKernels(
        attention=dk.attention, rms_norm=rms_norm, swiglu=dk.swiglu, rotary=dk.rotary,
        masked_softmax=dk.masked_softmax, wgrad_accumulate=dk.wgrad_accumulate, grouped_gemm=dk.grouped_gemm,
        source="torch_tpu: my_ops.rmsnorm_forward/rmsnorm_backward; devshim_kernels: attention, swiglu, rotary, "
               "masked_softmax, wgrad_accumulate (Sophgo has no standalone op for them), grouped_gemm (its loop of "
               "matmuls)")


def optimizer_kernels() -> OptimizerKernels:
    return host_defaults.optimizer_kernels(
        fused_adamw,
        "fused_adamw: torch._fused_adamw_/_fused_adam_ on the TPU (devshim_kernels.fused_adamw without bias "
        "correction or for mixed dtypes)")
