"""Attention in the layouts vendors use, on top of ``scaled_dot_product_attention``.

PyTorch's conventions at the boundary: a boolean ``attn_mask`` marks positions to *keep* unless
``mask_true_means_masked=True`` (the Ascend convention); ``scale=None`` means ``1/sqrt(head_dim)``.
Grouped-query attention is accepted wherever the key/value head count divides the query head count.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
LAYOUTS = ("BNSD", "BSND", "BSH", "SBH", "TND")


def _heads_of(x: Tensor, head_dim: int) -> int:
    if x.shape[-1] % head_dim:
        raise ValueError(f"hidden size {x.shape[-1]} is not a multiple of head_dim {head_dim}")
    return x.shape[-1] // head_dim


def to_bnsd(x: Tensor, layout: str, head_dim: int | None = None) -> Tensor:
    """View ``x`` in ``layout`` as [batch, heads, seq, head_dim] (``head_dim`` needed for BSH/SBH)."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout in ("BSH", "SBH"):
        if head_dim is None:
            raise ValueError(f"layout {layout} needs head_dim (or num_heads) to split the hidden dimension")
        n = _heads_of(x, head_dim)
        if layout == "BSH":
            return x.unflatten(-1, (n, head_dim)).transpose(1, 2)
        return x.unflatten(-1, (n, head_dim)).permute(1, 2, 0, 3)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def from_bnsd(x: Tensor, layout: str) -> Tensor:
    """Inverse of :func:`to_bnsd` (contiguous result)."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2).contiguous()
    if layout == "BSH":
        return x.transpose(1, 2).flatten(-2).contiguous()
    if layout == "SBH":
        return x.permute(2, 0, 1, 3).flatten(-2).contiguous()
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def _keep_mask(attn_mask: Tensor | None, true_means_masked: bool) -> Tensor | None:
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return ~attn_mask if true_means_masked else attn_mask


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout_p: float,
          scale: float | None) -> Tensor:
    gqa = k.shape[1] != q.shape[1]
    if gqa and q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if causal and mask is not None:
        s_q, s_k = q.shape[-2], k.shape[-2]
        lower = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()  # top-left, as SDPA
        mask = mask & lower if mask.dtype == torch.bool else mask.masked_fill(~lower, float("-inf"))
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)


def attention(q: Tensor, k: Tensor, v: Tensor, *, layout: str = "BNSD", num_heads: int | None = None,
              attn_mask: Tensor | None = None, mask_true_means_masked: bool = False, causal: bool = False,
              dropout_p: float = 0.0, scale: float | None = None, cu_seqlens_q: Tensor | None = None,
              cu_seqlens_kv: Tensor | None = None) -> Tensor:
    """Scaled dot-product attention; the output has ``q``'s layout and shape.

    ``num_heads`` (query heads) is required for ``BSH``/``SBH``. ``TND`` is packed variable-length
    input [tokens, heads, head_dim] with cumulative sequence lengths ``cu_seqlens_q``/``cu_seqlens_kv``
    (e.g. lengths [2, 2, 2] -> [0, 2, 4, 6] or, vendor style, [2, 4, 6]); masks do not apply to it.
    """
    mask = _keep_mask(attn_mask, mask_true_means_masked)
    if layout == "TND":
        return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, dropout_p, scale)
    head_dim = None
    if layout in ("BSH", "SBH"):
        if num_heads is None:
            raise ValueError(f"layout {layout} needs num_heads")
        head_dim = q.shape[-1] // num_heads
    out = _sdpa(to_bnsd(q, layout, head_dim), to_bnsd(k, layout, head_dim), to_bnsd(v, layout, head_dim), mask,
                causal, dropout_p, scale)
    return from_bnsd(out, layout)


def _offsets(cu: Tensor | None, name: str) -> list[int]:
    if cu is None:
        raise ValueError(f"layout TND needs {name}")
    offsets = [int(x) for x in cu.tolist()]
    if offsets[0] != 0:
        offsets = [0, *offsets]
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"{name} must be non-decreasing cumulative lengths, got {offsets}")
    return offsets


def _varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_kv: Tensor | None, causal: bool,
            dropout_p: float, scale: float | None) -> Tensor:
    offs_q = _offsets(cu_q, "cu_seqlens_q")
    offs_kv = _offsets(cu_kv if cu_kv is not None else cu_q, "cu_seqlens_kv")
    if len(offs_q) != len(offs_kv):
        raise ValueError("cu_seqlens_q and cu_seqlens_kv describe different numbers of sequences")
    if offs_q[-1] != q.shape[0] or offs_kv[-1] != k.shape[0]:
        raise ValueError(f"cumulative lengths end at {offs_q[-1]}/{offs_kv[-1]} but q/k hold {q.shape[0]}/"
                         f"{k.shape[0]} tokens")
    outs = []
    for i in range(len(offs_q) - 1):
        qi = q[offs_q[i]:offs_q[i + 1]].transpose(0, 1).unsqueeze(0)
        ki = k[offs_kv[i]:offs_kv[i + 1]].transpose(0, 1).unsqueeze(0)
        vi = v[offs_kv[i]:offs_kv[i + 1]].transpose(0, 1).unsqueeze(0)
        outs.append(_sdpa(qi, ki, vi, None, causal, dropout_p, scale).squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)
