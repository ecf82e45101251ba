"""Causal self-attention as row blocks of batched GEMMs, for short sequences on CPU.

Query rows go in blocks of ``BLOCK``; block i multiplies only against keys [0, end of block i), so about half
of the score matrix (everything above the diagonal blocks) is never computed, while every product stays a
large ``bmm`` that MKL runs near peak. The forward keeps each block's probabilities for the backward (no
recomputation). Forward+backward then beats SDPA's CPU flash kernel, whose backward is its weak side: ~1.4x
at 512 tokens, ~1.2x at 1024, a few percent at 2048 (bench/attention.py); the forward alone does not, so
callers use this only for training. The price is memory quadratic in the sequence: callers use it only under
:data:`MAX_SAVED_BYTES` and fall back to the flash kernel, whose memory is linear, above that.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

Tensor = torch.Tensor
BLOCK = 128  # query rows per GEMM: smaller wastes GEMM efficiency, larger computes more of the masked triangle
MAX_SAVED_BYTES = 256 << 20
DTYPES = (torch.float32, torch.float64)  # bf16/fp16 GEMMs on CPUs without native support lose to flash


def saved_bytes(batch_heads: int, seq: int, itemsize: int) -> int:
    """Bytes of probabilities the forward keeps for the backward."""
    return sum(batch_heads * (end - start) * end for start, end in _blocks(seq)) * itemsize


def blocked_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Top-left causal attention of [batch, heads, seq, dim] tensors with equal query and key lengths.

    Grouped-query keys/values are repeated to the query heads (autograd sums their gradients back)."""
    b, n, s, d = q.shape
    if k.shape[1] != n:
        k, v = k.repeat_interleave(n // k.shape[1], 1), v.repeat_interleave(n // v.shape[1], 1)
    scale = d ** -0.5 if scale is None else scale
    q3, k3, v3 = q.reshape(b * n, s, d), k.reshape(b * n, s, d), v.reshape(b * n, s, v.shape[-1])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _BlockedCausal.apply(q3, k3, v3, scale)
    else:
        out = _forward(q3 * scale, k3, v3, keep=False)[0]
    return out.view(b, n, s, v.shape[-1])


def _blocks(seq: int) -> list[tuple[int, int]]:
    return [(start, min(seq, start + BLOCK)) for start in range(0, seq, BLOCK)]


@functools.lru_cache(maxsize=8)
def _above_diagonal(rows: int, device: torch.device) -> Tensor:
    return torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)


def _forward(q_scaled: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list[Tensor]]:
    bn, s, _ = q_scaled.shape
    out = q_scaled.new_empty(bn, s, v.shape[-1])
    kept = []
    for start, end in _blocks(s):
        scores = torch.bmm(q_scaled[:, start:end], k[:, :end].transpose(1, 2))
        scores[:, :, start:].masked_fill_(_above_diagonal(end - start, scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        torch.bmm(probs, v[:, :end], out=out[:, start:end])
        if keep:
            kept.append(probs)
    return out, kept


class _BlockedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        q_scaled = q * scale  # scaling [s, d] here is cheaper than scaling [s, s] scores
        out, probs = _forward(q_scaled, k, v, keep=True)
        ctx.save_for_backward(q_scaled, k, v, *probs)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q_scaled, k, v, *probs = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q_scaled), torch.zeros_like(k), torch.zeros_like(v)
        for (start, end), p in zip(_blocks(q_scaled.shape[1]), probs, strict=True):
            g = grad[:, start:end]
            dv[:, :end].baddbmm_(p.transpose(1, 2), g)
            dp = torch.bmm(g, v[:, :end].transpose(1, 2))
            ds = torch.ops.aten._softmax_backward_data(dp, p, -1, p.dtype)  # p * (dp - rowsum(dp * p))
            torch.bmm(ds, k[:, :end], out=dq[:, start:end])
            dk[:, :end].baddbmm_(ds.transpose(1, 2), q_scaled[:, start:end])
        return dq.mul_(ctx.scale), dk, dv, None
