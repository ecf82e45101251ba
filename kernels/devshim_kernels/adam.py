"""Adam/AdamW with ``torch.optim.AdamW``'s arithmetic: bias correction ``1 - beta**step``, decoupled decay.

``fused_adamw`` updates lists of device tensors; ``host_adam_step``/``host_adam_rollback`` serve
ZeRO-Offload's host optimizer (DeepSpeed's ``cpu_adam`` API). Where the dtypes allow it the update runs
in PyTorch's fused kernel; otherwise it is computed in fp32 and written back in the tensors' dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def _fusable(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> bool:
    dtype = param.dtype
    return (dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
            and grad.dtype == dtype and exp_avg.dtype == dtype and exp_avg_sq.dtype == dtype)


def _fused(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], *,
           step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           adamw_mode: bool) -> None:
    step_tensor = torch.tensor(float(step), dtype=torch.float32, device=params[0].device)
    kernel = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, [], [step_tensor] * len(params), lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def _corrections(step: int, beta1: float, beta2: float, bias_correction: bool) -> tuple[float, float]:
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**step


def _as_fp32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _reference_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
                    bias_correction: bool) -> None:
    p, g, m, v = _as_fp32(param), _as_fp32(grad), _as_fp32(exp_avg), _as_fp32(exp_avg_sq)
    if weight_decay and not adamw_mode:
        g = g.add(p, alpha=weight_decay)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1, bc2 = _corrections(step, beta1, beta2, bias_correction)
    if weight_decay and adamw_mode:
        p.mul_(1.0 - lr * weight_decay)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)
    for target, value in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        if target is not value:
            target.copy_(value)


@torch.no_grad()  # an optimizer update, never part of a graph (params may be leaves)
def fused_adamw(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, adamw_mode: bool = True, bias_correction: bool = True) -> None:
    """One Adam(W) step over lists of tensors, in place. ``step`` counts this update (1 for the first)."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (the number of this update), got {step}")
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], ...]] = {}
    for quad in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if bias_correction and _fusable(*quad):
            group = groups.setdefault((quad[0].device, quad[0].dtype), ([], [], [], []))
            for bucket, tensor in zip(group, quad, strict=True):
                bucket.append(tensor)
        else:
            _reference_step(*quad, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                            adamw_mode=adamw_mode, bias_correction=bias_correction)
    for group in groups.values():
        _fused(*group, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
               adamw_mode=adamw_mode)


@torch.no_grad()
def host_adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool = True,
                   bias_correction: bool = True) -> None:
    """One Adam(W) step on host tensors; params fp32/bf16/fp16, states fp32 or the param dtype."""
    fused_adamw([param.view(-1)], [grad.view(-1)], [exp_avg.view(-1)], [exp_avg_sq.view(-1)], step=step, lr=lr,
                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                bias_correction=bias_correction)


@torch.no_grad()
def host_adam_rollback(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                       beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool = True,
                       bias_correction: bool = True) -> None:
    """Undo the update :func:`host_adam_step` made at ``step`` with the same gradient and hyperparameters."""
    p, g, m, v = _as_fp32(param), _as_fp32(grad), _as_fp32(exp_avg), _as_fp32(exp_avg_sq)
    bc1, bc2 = _corrections(step, beta1, beta2, bias_correction)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=lr / bc1)
    if weight_decay and adamw_mode:
        p.div_(1.0 - lr * weight_decay)
    if weight_decay and not adamw_mode:
        g = g.add(p, alpha=weight_decay)
    m.sub_(g, alpha=1.0 - beta1).div_(beta1)
    v.addcmul_(g, g, value=-(1.0 - beta2)).div_(beta2).clamp_(min=0.0)
    for target, value in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        if target is not value:
            target.copy_(value)
