"""Attention that also returns each query's log-sum-exp of its scores: what blockwise (ring) attention needs to
merge the partial results of key/value blocks with an online softmax.

``lse[b, n, i] = log(sum_j exp(scale * q_i . k_j))`` over the keys query ``i`` may attend to (``-inf`` for a query
that may attend to none, whose output is zeros). Both outputs are differentiable in ``q``, ``k`` and ``v``: the
merge's weights depend on the statistics, so a gradient flows through them.

:func:`with_lse_gradient` gives a statistic that a vendor kernel returns without a gradient (Ascend's
``softmax_max``/``softmax_sum``) the gradient of the log-sum-exp, recomputed from ``q`` and ``k`` in the backward.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor
__all__ = ["attention_with_lse", "keep_mask", "with_lse_gradient"]


def keep_mask(attn_mask: Tensor | None, mask_true_means_masked: bool, causal: bool, s_q: int, s_k: int,
              device: torch.device) -> Tensor | None:
    """A boolean mask (True = attends) combining a boolean/integer ``attn_mask`` and a top-left causal triangle."""
    keep = None
    if attn_mask is not None:
        if attn_mask.is_floating_point():
            raise ValueError("attention_with_lse takes a boolean or integer attn_mask, not an additive one")
        keep = attn_mask.bool()
        keep = ~keep if mask_true_means_masked else keep
    if causal:
        triangle = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril()
        keep = triangle if keep is None else keep & triangle
    return keep


def _scores(q: Tensor, k: Tensor, keep: Tensor | None, scale: float) -> Tensor:
    """Scores [B, N, Sq, Sk] in fp32 (fp64 for fp64 inputs), masked cells -inf; key/value heads repeated up to the
    query's (GQA)."""
    if q.shape[1] != k.shape[1]:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    wide = _wide(q.dtype)
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale
    return scores if keep is None else scores.masked_fill(~keep, float("-inf"))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _safe_lse(scores: Tensor) -> tuple[Tensor, Tensor]:
    """(probabilities, log-sum-exp) of fp32 scores whose rows may be all -inf (probabilities 0, lse -inf), with
    finite gradients everywhere."""
    peak = scores.amax(-1, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # the identity holds for any shift
    exp = torch.exp(scores - peak)
    total = exp.sum(-1, keepdim=True)
    some = total > 0
    safe_total = torch.where(some, total, torch.ones_like(total))
    lse = torch.where(some, peak + torch.log(safe_total), torch.full_like(total, float("-inf")))
    return exp / safe_total, lse.squeeze(-1)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                       mask_true_means_masked: bool = False, causal: bool = False, scale: float | None = None,
                       dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` for [B, N, S, D] ``q``/``k``/``v`` (BNSD; GQA key/value heads divide the query heads).

    ``out`` has ``q``'s dtype; ``lse`` [B, N, Sq] is fp32 (fp64 for fp64 inputs). The scores are computed in that
    dtype and materialised: this is the reference, and the path for blocks of a sequence split over ranks.
    ``causal`` is top-left. ``dropout_p`` drops probabilities (survivors scaled by 1/(1-p)) after ``lse`` is taken:
    blocks merged by their statistics then drop exactly what attention over all keys would."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected 4-D BNSD q/k/v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = keep_mask(attn_mask, mask_true_means_masked, causal, q.shape[-2], k.shape[-2], q.device)
    probs, lse = _safe_lse(_scores(q, k, keep, scale))
    if dropout_p:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    if v.shape[1] != q.shape[1]:
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.matmul(probs, v.to(probs.dtype)).to(q.dtype), lse


class _LseGradient(torch.autograd.Function):
    """The identity on ``lse`` in the forward; the log-sum-exp's gradient for ``q`` and ``k`` in the backward:
    d lse_i / d q_i = scale * sum_j p_ij k_j and d lse_i / d k_j = scale * p_ij q_i."""

    @staticmethod
    def forward(ctx: Any, lse: Tensor, q: Tensor, k: Tensor, keep: Tensor | None, scale: float) -> Tensor:
        ctx.save_for_backward(q, k, keep)
        ctx.scale = scale
        return lse.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        q, k, keep = ctx.saved_tensors
        groups = q.shape[1] // k.shape[1]
        probs, _ = _safe_lse(_scores(q, k, keep, ctx.scale))
        weighted = probs * grad.to(probs.dtype).unsqueeze(-1)  # dlse_i * p_ij
        grad_q = torch.matmul(weighted, k.to(probs.dtype).repeat_interleave(groups, dim=1)) * ctx.scale
        grad_k = torch.matmul(weighted.transpose(-1, -2), q.to(probs.dtype)) * ctx.scale
        if groups > 1:  # a key/value head serves `groups` query heads: their gradients add up
            grad_k = grad_k.unflatten(1, (k.shape[1], groups)).sum(2)
        return None, grad_q.to(q.dtype), grad_k.to(k.dtype), None, None


def with_lse_gradient(lse: Tensor, q: Tensor, k: Tensor, *, keep: Tensor | None, scale: float) -> Tensor:
    """``lse`` (detached, e.g. from a vendor kernel's softmax statistics) as a function of ``q`` and ``k`` for
    autograd. ``keep``: the boolean mask the kernel applied (True = attends), broadcastable to the scores."""
    return _LseGradient.apply(lse.detach(), q, k, keep, scale)
