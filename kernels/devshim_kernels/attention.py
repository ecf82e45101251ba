"""Attention in the layouts vendors use, on top of ``scaled_dot_product_attention``.

PyTorch's conventions at the boundary: a boolean (or integer) ``attn_mask`` marks positions to *keep* unless
``mask_true_means_masked=True`` (the Ascend convention); a floating mask is added to the scores. ``scale=None``
means ``1/sqrt(head_dim)``. Grouped-query attention is accepted wherever the key/value head count divides the
query head count. A query that may attend to no key at all gets a zero output (and zero gradient).

Everything below is views plus one attention call per batch (per sequence for packed ``TND`` input of unequal
lengths). The call is SDPA, with its own backward, except for causal plus a mask on CPU: SDPA refuses
``is_causal`` together with a mask, and folding the triangle into the mask costs the flash kernel its block
skipping (~30% at 1k tokens), so this calls the kernel SDPA itself dispatches to, which takes both.

There is no kernel of devshim's own here: where devshim's attention serves a framework it must be no slower than
SDPA and hold no more memory (issue 30). A blocked GEMM kernel that skipped the masked triangle was faster at
512 tokens in fp32 but kept the causal blocks of the probabilities for the backward (1.9-5.1x SDPA's peak
memory at 512-2048 tokens) and was slower from 1024 tokens on this project's machine; it was removed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, cast

import torch
import torch.nn.functional as F

from devshim_kernels.layouts import LAYOUTS, check_layout, from_bnsd, to_bnsd
from devshim_kernels.varlen import CuSeqlens, seq_lengths

_log = logging.getLogger("devshim.kernels")  # a child of devshim's logger: DEVSHIM_LOG_LEVEL=debug shows each path

Tensor = torch.Tensor
CausalAlignment = Literal["top_left", "bottom_right"]
__all__ = ["LAYOUTS", "attention"]

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def attention(q: Tensor, k: Tensor, v: Tensor, *, layout: str = "BNSD", num_heads: int | None = None,
              attn_mask: Tensor | None = None, mask_true_means_masked: bool = False, causal: bool = False,
              dropout_p: float = 0.0, scale: float | None = None, cu_seqlens_q: CuSeqlens | None = None,
              cu_seqlens_kv: CuSeqlens | None = None, causal_alignment: CausalAlignment = "top_left") -> Tensor:
    """Scaled dot-product attention; the output has ``q``'s layout (``v``'s head size).

    - ``layout``: ``BNSD`` [batch, heads, seq, dim], ``BSND``, ``BSH``/``SBH`` (heads folded into the hidden
      size; ``num_heads`` = query heads is then required), or ``TND``: packed variable-length [tokens, heads,
      dim] delimited by ``cu_seqlens_q``/``cu_seqlens_kv`` (lengths [2, 3] as [0, 2, 5] or, vendor style,
      [2, 5]; ``cu_seqlens_kv`` defaults to ``cu_seqlens_q``).
    - ``attn_mask``: broadcastable to [batch, heads, seq_q, seq_kv] whatever the layout (vendors' BNSS, B1SS,
      11SS, SS); not accepted with ``TND``, whose sequences are separated by the cumulative lengths.
    - ``causal``: query i sees keys j <= i (``causal_alignment="top_left"``, as SDPA and Ascend's
      ``sparse_mode=2``) or j <= i + seq_kv - seq_q (``"bottom_right"``, as flash-attn and ``sparse_mode=3``);
      the two agree when seq_q == seq_kv. Combines with ``attn_mask``.
    - ``dropout_p``: dropout on the attention probabilities, survivors scaled by 1/(1-p) (vendors'
      ``keep_prob`` is 1 - p). Draws from torch's default generator, so ``torch.manual_seed`` reproduces it.
    """
    check_layout(layout)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    mask = _additive_or_keep_mask(attn_mask, mask_true_means_masked)
    if layout == "TND":
        if attn_mask is not None:
            raise ValueError("layout TND takes no attn_mask: cu_seqlens_q/cu_seqlens_kv separate the sequences")
        if cu_seqlens_q is None:
            raise ValueError("layout TND needs cu_seqlens_q")
        _check_heads(q, layout, num_heads)
        return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q,
                       causal, causal_alignment, dropout_p, scale)
    qb, kb, vb = _dense_views(q, k, v, layout, num_heads)
    return from_bnsd(_bnsd(qb, kb, vb, mask, causal, causal_alignment, dropout_p, scale), layout)


def _additive_or_keep_mask(attn_mask: Tensor | None, true_means_masked: bool) -> Tensor | None:
    """The mask as SDPA reads it: boolean True = attend, or a floating additive bias."""
    if attn_mask is None or attn_mask.is_floating_point():
        return attn_mask
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask != 0  # vendors also take uint8
    return ~keep if true_means_masked else keep


def _check_heads(q: Tensor, layout: str, num_heads: int | None) -> None:
    if num_heads is not None and layout not in ("BSH", "SBH"):
        heads = q.shape[1] if layout in ("BNSD", "TND") else q.shape[2]
        if heads != num_heads:
            raise ValueError(f"num_heads={num_heads} but q in layout {layout} has {heads} heads")


def _dense_views(q: Tensor, k: Tensor, v: Tensor, layout: str, num_heads: int | None) -> tuple[Tensor, ...]:
    if layout not in ("BSH", "SBH"):
        _check_heads(q, layout, num_heads)
        return to_bnsd(q, layout), to_bnsd(k, layout), to_bnsd(v, layout)
    if num_heads is None:
        raise ValueError(f"layout {layout} needs num_heads")
    if q.shape[-1] % num_heads:
        raise ValueError(f"hidden size {q.shape[-1]} is not a multiple of num_heads {num_heads}")
    head_dim = q.shape[-1] // num_heads
    kb = to_bnsd(k, layout, head_dim)
    return to_bnsd(q, layout, head_dim), kb, to_bnsd(v, layout, v.shape[-1] // kb.shape[1])


def _bnsd(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, alignment: CausalAlignment,
          dropout_p: float, scale: float | None) -> Tensor:
    """Attention on [batch, heads, seq, dim] tensors (``mask``: keep-boolean or additive)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected 4-D q/k/v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not describe one attention")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if mask is not None:
        if mask.dim() > 4:
            raise ValueError(f"attn_mask of shape {tuple(mask.shape)} has more than 4 dimensions")
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # SDPA refuses e.g. a 1-D key mask
    s_q, s_k = q.shape[-2], k.shape[-2]
    bottom_right = alignment == "bottom_right" and s_q != s_k
    if causal and (mask is not None or bottom_right):
        # (mask is not None: it is, when not bottom_right; said again for the type checker)
        if not bottom_right and mask is not None and _flash_cpu_applies(q, k, v, mask, dropout_p):
            if _log.isEnabledFor(logging.DEBUG):
                _log.debug("attention %s %s: flash attention for CPU, causal with a mask", tuple(q.shape), q.dtype)
            return _flash_cpu(q, k, v, mask, scale)
        triangle = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q if bottom_right else 0)
        mask = triangle if mask is None else _restrict(mask, triangle)
        causal = False
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("attention %s %s: scaled_dot_product_attention (mask %s, causal %s)", tuple(q.shape), q.dtype,
                   mask is not None, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _restrict(mask: Tensor, keep: Tensor) -> Tensor:
    return mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))


def _flash_cpu_applies(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float) -> bool:
    """Whether SDPA's CPU flash kernel takes these inputs (the conditions SDPA checks before choosing it)."""
    return (_FLASH_CPU is not None and q.device.type == "cpu" and torch.backends.cuda.flash_sdp_enabled()
            and dropout_p == 0.0 and q.dtype in _FLASH_CPU_DTYPES and k.dtype == v.dtype == q.dtype
            and q.shape[-1] == v.shape[-1] and min(q.shape[-2], k.shape[-2]) > 0 and not mask.requires_grad
            and all(t.stride(-1) == 1 for t in (q, k, v)))


def _flash_cpu(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """Causal (top-left) attention plus a 4-D mask in one call of the CPU flash kernel, which skips the blocks
    above the diagonal; it wants the mask additive, in the inputs' dtype."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    else:
        mask = mask.to(q.dtype)
    flash = cast("Callable[..., tuple[Tensor, ...]]", _FLASH_CPU)  # not None: _flash_cpu_applies checked it
    return flash(q, k, v, 0.0, True, attn_mask=mask, scale=scale)[0]


def _varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: CuSeqlens, cu_kv: CuSeqlens, causal: bool,
            alignment: CausalAlignment, dropout_p: float, scale: float | None) -> Tensor:
    """Packed [tokens, heads, dim] attention, each sequence attending only within itself."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"layout TND expects 3-D q/k/v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    len_q = seq_lengths(cu_q, total=q.shape[0], name="cu_seqlens_q")
    len_kv = seq_lengths(cu_kv, total=k.shape[0], name="cu_seqlens_kv")
    if len(len_q) != len(len_kv):
        raise ValueError(f"cu_seqlens_q describes {len(len_q)} sequences but cu_seqlens_kv {len(len_kv)}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k holds {k.shape[0]} tokens but v {v.shape[0]}")

    def run(qs: Tensor, ks: Tensor, vs: Tensor) -> Tensor:  # [B, S, N, D] views in, [B, S, N, Dv] out
        bnsd = _bnsd(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), None, causal, alignment,
                     dropout_p, scale)
        return from_bnsd(bnsd, "BSND")

    if len(set(len_q)) == 1 and len(set(len_kv)) == 1 and len_q[0] and len_kv[0]:
        # equal lengths (fixed-length packing): one batched call on BSND views, no copies
        b = len(len_q)
        return run(q.unflatten(0, (b, -1)), k.unflatten(0, (b, -1)), v.unflatten(0, (b, -1))).flatten(0, 1)
    outs = []
    for qs, ks, vs in zip(q.split(len_q), k.split(len_kv), v.split(len_kv), strict=True):
        if qs.shape[0] and ks.shape[0]:
            outs.append(run(qs[None], ks[None], vs[None])[0])
        else:  # no queries, or queries with no key to attend to: zeros, like a fully masked row
            outs.append(qs.new_zeros(qs.shape[0], qs.shape[1], v.shape[-1]))
    return torch.cat(outs)
