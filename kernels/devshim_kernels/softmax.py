"""Scaled, masked softmax over attention scores, as Megatron's fused kernels (``scaled_masked_softmax_cuda``,
``scaled_upper_triang_masked_softmax_cuda``) and its unfused PyTorch path compute it.

Masked positions are filled with -10000.0 after scaling, not -inf: that is what both of Megatron's paths do, so a
row with any unmasked position gets exactly Megatron's probabilities. A row with every position masked is all
zeros, as the CUDA kernel writes it (Megatron's unfused path would spread it uniformly over the masked keys); its
gradient is zero in both.
"""

from __future__ import annotations

from typing import Any

import torch

from devshim_kernels.shapes import broadcasts_to

Tensor = torch.Tensor
MASKED_FILL = -10000.0  # Megatron's attention_mask_func and its CUDA kernels


def masked_softmax(scores: Tensor, mask: Tensor | None, scale: float, *, causal: bool = False) -> Tensor:
    """``softmax(scores * scale)`` over the last dimension with masked positions filled with -10000.0.

    - ``scores``: [b, np, sq, sk] attention scores in fp16, bf16, fp32 or fp64; the result has their dtype,
      the statistics are computed in fp32 (fp64 for fp64 scores).
    - ``mask``: boolean, ``True`` = masked (Megatron's convention), broadcastable to ``scores`` ([b, 1, sq, sk],
      [1, 1, sq, sk], [sq, sk]); integer masks count non-zero as masked; ``None`` for no mask.
    - ``causal``: also mask key j > query i (upper triangle, top-left aligned); combines with ``mask``.

    Differentiable in ``scores``: ``d scores = scale * y * (dy - sum(dy * y))``, zero at masked positions.
    """
    if scores.dim() != 4:
        raise ValueError(f"masked_softmax expects [b, np, sq, sk] scores, got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"masked_softmax expects floating scores, got {scores.dtype}")
    masked = _masked_positions(scores, mask, causal)
    return _MaskedSoftmax.apply(scores, masked, float(scale))


def _masked_positions(scores: Tensor, mask: Tensor | None, causal: bool) -> Tensor | None:
    """The boolean tensor (broadcastable to ``scores``) of positions to mask, or ``None``."""
    masked = None
    if mask is not None:
        if mask.is_floating_point():
            raise ValueError("masked_softmax takes a boolean mask (True = masked), not an additive float mask")
        if not broadcasts_to(mask.shape, scores.shape):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to scores {tuple(scores.shape)}")
        masked = mask if mask.dtype == torch.bool else mask != 0
    if causal:
        s_q, s_k = scores.shape[-2:]
        upper = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu_(1)
        masked = upper if masked is None else masked | upper
    return masked


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scores: Tensor, masked: Tensor | None, scale: float) -> Tensor:
        cdt = _compute_dtype(scores.dtype)
        # scaled in the compute dtype, as Megatron's unfused path (input.float() * scale) and its kernels do
        x = scores * scale if scores.dtype == cdt else scores.to(cdt).mul_(scale)
        if masked is not None:
            x.masked_fill_(masked, MASKED_FILL)
        probs = torch.softmax(x, dim=-1)
        if masked is not None:
            fully_masked = masked.all(dim=-1, keepdim=True)
            if fully_masked.any():
                probs.masked_fill_(fully_masked, 0.0)
        out = probs if probs.dtype == scores.dtype else probs.to(scores.dtype)
        ctx.save_for_backward(out, masked)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        out, masked = ctx.saved_tensors
        cdt = _compute_dtype(out.dtype)
        dx = torch._softmax_backward_data(grad.to(cdt), out.to(cdt), -1, cdt).mul_(ctx.scale)
        if masked is not None:  # the fill cuts masked positions off from the scores, as masked_fill_'s gradient
            dx.masked_fill_(masked, 0.0)
        return dx.to(out.dtype), None, None
