"""Huawei's ``torch_npu`` operators (simulated): real ``torch.library`` ops in the dispatcher namespace ``npu``.

``torch.ops.npu.npu_rms_norm`` and ``torch_npu.npu_rms_norm`` are the same operator, with the vendor's schema and
semantics (Ascend op-plugin docs and schemas: ``npu_fusion_attention``, ``npu_rms_norm``, ``npu_swiglu``,
``npu_rotary_mul``, ``npu_apply_adam_w``). The arithmetic is plain torch (its own ``scaled_dot_product_attention``
for the attention, written-out formulas for the rest), never ``devshim_kernels``: the conformance kit compares the
plugins' kernels, which run these ops, with ``devshim_kernels`` on the host, so these must be a second, independent
implementation, with their own layout conversions and mask polarity (a mistake made the same way on both sides
would pass). The differentiable ops are ``CompositeImplicitAutograd`` kernels, so autograd differentiates their
arithmetic (``npu_apply_adam_w`` follows the vendor's own formula: it takes beta powers, not a step). Like the
vendor's, every op refuses tensors that are not on an NPU. Not Huawei's code.

Where the emulation differs from the hardware (documented per op): ``npu_fusion_attention``'s dropout draws
from torch's generator (seed/offset are 0), ``sparse_mode`` 4-8 (band, prefix, varlen outer-cut) with a mask are
refused instead of computed, and ``inner_precise``, ``gen_mask_parallel`` and ``sync`` (precision and scheduling
knobs) are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
DEVICE = "npu"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
COMPRESSED_MASK_SIZE = 2048  # sparse_mode 2/3 take the 2048x2048 upper-triangle mask, whatever the sequence length
_MAX_INT32 = 2147483647
_SEQ_DIM = {"BSH": 1, "SBH": 0, "BSND": 1, "BNSD": 2}

_LIB = torch.library.Library("npu", "FRAGMENT")  # kept referenced: dropping it unregisters the ops


def _on_npu(op: str, **tensors: Tensor | None) -> None:
    """Refuse host tensors (and tensors on different NPUs), as the vendor kernels do."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != DEVICE:
            raise RuntimeError(f"{op}: {name} is on {t.device}, but torch_npu kernels run on NPU tensors only; "
                               f"move it with .npu() or .to('npu')")
        if device is None:
            device = t.device
        elif t.device != device:
            raise RuntimeError(f"{op}: expected all tensors on one NPU, found {device} and {t.device} ({name})")


def _float_dtype(op: str, name: str, t: Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")


# -- npu_fusion_attention ------------------------------------------------------------------------------------------

_LIB.define(
    "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
    "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
    "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
    "bool sync=False) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)")

_checked_compressed: dict[tuple[Any, ...], bool] = {}


def _check_compressed_mask(mask: Tensor, sparse_mode: int) -> None:
    """sparse_mode 2/3 read the causal triangle from the compressed mask; the vendor computes garbage with any
    other mask, so the emulation insists on the real one (checked once per mask version)."""
    size = COMPRESSED_MASK_SIZE
    if tuple(mask.shape) != (size, size):
        raise ValueError(f"npu_fusion_attention: sparse_mode={sparse_mode} takes the compressed causal mask "
                         f"torch.triu(torch.ones({size}, {size}, dtype=torch.bool), diagonal=1), got atten_mask of "
                         f"shape {tuple(mask.shape)}")
    key = (mask.data_ptr(), mask._version, str(mask.device), mask.dtype)
    if key not in _checked_compressed:
        upper = torch.ones(size, size, dtype=torch.bool, device=mask.device).triu_(1)
        _checked_compressed.clear()  # one live entry is enough: callers build this mask once
        _checked_compressed[key] = bool(torch.equal(mask.bool(), upper))
    if not _checked_compressed[key]:
        raise ValueError(f"npu_fusion_attention: sparse_mode={sparse_mode} takes the compressed causal mask "
                         f"torch.triu(torch.ones({size}, {size}, dtype=torch.bool), diagonal=1); this atten_mask "
                         "has other values")


def _vendor_lengths(name: str, cumulative: Sequence[int] | None) -> list[int]:
    """Per-sequence lengths from Ascend's cumulative lengths without a leading 0 ([2, 4, 6] for lengths 2, 2, 2).
    Trailing zeros mark batches that take no part ([2, 5, 9, 0, 0])."""
    if cumulative is None:
        raise ValueError(f"npu_fusion_attention: input_layout TND needs {name} (cumulative lengths, e.g. [2, 4, 6])")
    ends = [int(c) for c in cumulative]
    while len(ends) > 1 and ends[-1] == 0:
        ends.pop()
    lengths, start = [], 0
    for end in ends:
        if end < start:
            raise ValueError(f"npu_fusion_attention: {name} must be non-decreasing cumulative lengths, got {ends}")
        lengths.append(end - start)
        start = end
    return lengths


def _heads(t: Tensor, layout: str, head_num: int) -> tuple[int, int]:
    """(heads, head_dim) of a tensor in ``layout``; BSH/SBH fold the heads into the hidden size."""
    if layout in ("BSH", "SBH"):
        return head_num, t.shape[-1] // head_num
    return (t.shape[1] if layout in ("BNSD", "TND") else t.shape[2]), t.shape[-1]


def _stat_shapes(query: Tensor, layout: str, head_num: int) -> tuple[int, ...]:
    """The vendor's softmax_max/softmax_sum shape: [B, N, Sq, 8] (TND: [T, N, 8]), fp32."""
    if layout == "TND":
        return (query.shape[0], head_num, 8)
    return (query.shape[1 if layout == "SBH" else 0], head_num, query.shape[_SEQ_DIM[layout]], 8)


def _npu_fusion_attention(query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str,
                          pse: Tensor | None = None, padding_mask: Tensor | None = None,
                          atten_mask: Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
                          pre_tockens: int = _MAX_INT32, next_tockens: int = _MAX_INT32, inner_precise: int = 0,
                          prefix: Sequence[int] | None = None, actual_seq_qlen: Sequence[int] | None = None,
                          actual_seq_kvlen: Sequence[int] | None = None, sparse_mode: int = 0,
                          gen_mask_parallel: bool = True, sync: bool = False) -> tuple[Any, ...]:
    """``softmax(mask(scale * (pse + q @ k^T), atten_mask)) @ v`` with dropout ``1 - keep_prob``.

    ``atten_mask`` is bool/uint8 with **True (1) = masked out**, shaped BNSS, B1SS, 11SS or SS (TND: SS over the
    longest sequences). Without ``atten_mask`` the attention is full whatever ``sparse_mode`` says (vendor
    rule). ``sparse_mode`` 0/1: the mask as given (``pre_tockens``/``next_tockens`` must agree with it and are not
    read); 2: left-up causal, 3: right-down causal, both with the compressed 2048x2048 mask. TND takes
    ``actual_seq_qlen``/``actual_seq_kvlen`` cumulative without the leading 0.

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``: the output in the
    query's layout; softmax_max/softmax_sum in the vendor's shapes ([B, N, Sq, 8], TND [T, N, 8], fp32): each query's
    maximum scaled score and sum of exp(score - maximum) over the keys it attends to (-inf and 0 for a query with
    none), without a gradient, as the vendor's; softmax_out empty (reserved by the vendor too);
    seed = offset = 0 (dropout draws from torch's generator and autograd keeps its mask); numels = B*N*Sq*Skv when
    dropout is on, else 0.
    """
    op = "npu_fusion_attention"
    _on_npu(op, query=query, key=key, value=value, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask)
    for name, t in (("query", query), ("key", key), ("value", value)):
        _float_dtype(op, name, t)
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"{op}: query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if input_layout not in _LAYOUTS:
        raise ValueError(f"{op}: input_layout must be one of {', '.join(_LAYOUTS)}, got {input_layout!r}")
    if padding_mask is not None:
        raise ValueError(f"{op}: padding_mask is not supported (the vendor reserves it); pass atten_mask")
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"{op}: keep_prob must be in (0, 1], got {keep_prob}")
    if not 0 <= sparse_mode <= 8:
        raise ValueError(f"{op}: sparse_mode must be 0..8, got {sparse_mode}")
    if head_num < 1:
        raise ValueError(f"{op}: head_num must be >= 1, got {head_num}")
    want = 3 if input_layout in ("BSH", "SBH", "TND") else 4
    if query.dim() != want or key.dim() != want or value.dim() != want:
        raise ValueError(f"{op}: input_layout {input_layout} takes {want}-D query/key/value, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if input_layout in ("BSH", "SBH") and query.shape[-1] % head_num:
        raise ValueError(f"{op}: hidden size {query.shape[-1]} is not a multiple of head_num {head_num}")
    heads, _ = _heads(query, input_layout, head_num)
    if heads != head_num:
        raise ValueError(f"{op}: head_num={head_num} but query in layout {input_layout} has {heads} heads")
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"{op}: atten_mask must be bool or uint8 (True/1 = masked out), got {atten_mask.dtype}; "
                        "npu_fusion_attention has no additive mask")

    causal, alignment, mask = False, "top_left", atten_mask
    if atten_mask is not None:  # without a mask the vendor computes full attention whatever sparse_mode says
        if sparse_mode in (2, 3):
            _check_compressed_mask(atten_mask, sparse_mode)
            # 2: left-up (query i sees keys j <= i); 3: right-down (j <= i + Skv - Sq)
            causal, alignment, mask = True, ("top_left" if sparse_mode == 2 else "bottom_right"), None
        elif sparse_mode not in (0, 1):
            raise NotImplementedError(f"{op}: sparse_mode={sparse_mode} (band/prefix/varlen outer-cut) is not "
                                      "emulated; use 0/1 with a full mask or 2/3 with the compressed causal mask")
        elif atten_mask.dim() not in (2, 4):
            raise ValueError(f"{op}: atten_mask must be BNSS, B1SS, 11SS or SS, got shape {tuple(atten_mask.shape)}")
    dropout_p = 1.0 - keep_prob

    if input_layout == "TND":
        if pse is not None:
            raise NotImplementedError(f"{op}: pse with input_layout TND is not emulated")
        out, numels, peak, total = _tnd(query, key, value, mask, causal, alignment, dropout_p, scale,
                           _vendor_lengths("actual_seq_qlen", actual_seq_qlen),
                           _vendor_lengths("actual_seq_kvlen", actual_seq_kvlen))
    else:
        bias = None
        if pse is not None:  # scale * (pse + qk) = scale*qk + scale*pse: an additive bias, masked cells at -inf
            _float_dtype(op, "pse", pse)
            if pse.dim() != 4:
                raise ValueError(f"{op}: pse must be BNSS, BN1S or 1NSS, got shape {tuple(pse.shape)}")
            bias = pse.to(query.dtype) * scale
        kv_heads = key.shape[-1] // (query.shape[-1] // head_num) if input_layout in ("BSH", "SBH") else 0
        q = _to_bnsd(query, input_layout, head_num)
        k, v = _to_bnsd(key, input_layout, kv_heads), _to_bnsd(value, input_layout, kv_heads)
        keep = None if mask is None else ~mask.bool()  # the vendor's True = masked out; SDPA's True = attends
        if causal:
            keep = _causal_keep(q.shape[2], k.shape[2], alignment, query.device)
        out = _from_bnsd(_attend(q, k, v, keep, bias, dropout_p, scale), input_layout)
        b, n, s_q, _ = _stat_shapes(query, input_layout, head_num)
        numels = b * n * s_q * key.shape[_SEQ_DIM[input_layout]] if dropout_p else 0
        peak, total = _softmax_stats(q, k, keep, bias, scale)
    # the vendor's shape: each row's statistic repeated 8 times
    return (out, peak.unsqueeze(-1).expand(*peak.shape, 8).contiguous(),
            total.unsqueeze(-1).expand(*total.shape, 8).contiguous(), query.new_empty(0), 0, 0, numels)


def _tnd(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool, alignment: str,
         dropout_p: float, scale: float, len_q: list[int], len_kv: list[int]) -> tuple[Tensor, int, Tensor, Tensor]:
    """Packed varlen attention; a mask (SS over the longest sequences) is cut to each sequence's lengths. Returns
    the output, numels and the softmax statistics [T, N] (max, sum)."""
    if len(len_q) != len(len_kv):
        raise ValueError(f"npu_fusion_attention: actual_seq_qlen describes {len(len_q)} sequences but "
                         f"actual_seq_kvlen {len(len_kv)}")
    used_q, used_kv = sum(len_q), sum(len_kv)
    if used_q > query.shape[0] or used_kv > key.shape[0]:
        raise ValueError(f"npu_fusion_attention: actual_seq_qlen/kvlen cover {used_q}/{used_kv} tokens but query/key "
                         f"hold {query.shape[0]}/{key.shape[0]}")
    if mask is not None and mask.dim() != 2:
        raise ValueError(f"npu_fusion_attention: with input_layout TND atten_mask must be SS (maxSq x maxSkv), got "
                         f"shape {tuple(mask.shape)}")
    q, k, v = query[:used_q], key[:used_kv], value[:used_kv]
    outs, peaks, totals = [], [], []
    for qs, ks, vs, lq, lk in zip(q.split(len_q), k.split(len_kv), v.split(len_kv), len_q, len_kv, strict=True):
        if not (lq and lk):  # no queries, or queries with no key: zeros, like a fully masked row
            outs.append(qs.new_zeros(lq, qs.shape[1], v.shape[-1]))
            peaks.append(torch.full((lq, qs.shape[1]), float("-inf"), device=qs.device))
            totals.append(torch.zeros(lq, qs.shape[1], device=qs.device))
            continue
        keep = None if mask is None else ~mask[:lq, :lk].bool()  # the mask is cut to this sequence's lengths
        if causal:
            triangle = _causal_keep(lq, lk, alignment, query.device)
            keep = triangle if keep is None else keep & triangle
        # [T, N, D] -> [1, N, T, D] and back
        attended = _attend(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], keep, None,
                           dropout_p, scale)
        outs.append(attended[0].transpose(0, 1))
        peak, total = _softmax_stats(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], keep, None, scale)
        peaks.append(peak[0].transpose(0, 1))
        totals.append(total[0].transpose(0, 1))
    out, peak, total = torch.cat(outs), torch.cat(peaks), torch.cat(totals)
    if used_q < query.shape[0]:  # tokens past the last counted sequence take no part: zeros
        rest = query.shape[0] - used_q
        out = torch.cat((out, out.new_zeros(rest, *out.shape[1:])))
        peak = torch.cat((peak, peak.new_full((rest, peak.shape[1]), float("-inf"))))
        total = torch.cat((total, total.new_zeros(rest, total.shape[1])))
    numels = sum(a * b for a, b in zip(len_q, len_kv, strict=True)) * query.shape[1] if dropout_p else 0
    return out.contiguous(), numels, peak, total


def _to_bnsd(t: Tensor, layout: str, heads: int) -> Tensor:
    """``t`` as [batch, heads, seq, dim]: BSND swaps S and N; BSH/SBH split the hidden size into ``heads`` heads
    (head_num for the query; key/value may have fewer, GQA, and value another head size)."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        batch, seq, hidden = t.shape
        return t.reshape(batch, seq, heads, hidden // heads).transpose(1, 2)
    seq, batch, hidden = t.shape  # SBH
    return t.reshape(seq, batch, heads, hidden // heads).permute(1, 2, 0, 3)


def _from_bnsd(t: Tensor, layout: str) -> Tensor:
    """[batch, heads, seq, dim] back to ``layout``, contiguous as the vendor's output is."""
    batch, heads, seq, dim = t.shape
    if layout == "BSND":
        t = t.transpose(1, 2)
    elif layout == "BSH":
        t = t.transpose(1, 2).reshape(batch, seq, heads * dim)
    elif layout == "SBH":
        t = t.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)
    return t.contiguous()


def _causal_keep(s_q: int, s_kv: int, alignment: str, device: torch.device) -> Tensor:
    """The cells a causal query may attend to: j <= i (left-up, sparse_mode 2) or j <= i + Skv - Sq (right-down,
    sparse_mode 3)."""
    shift = s_kv - s_q if alignment == "bottom_right" else 0
    return torch.ones(s_q, s_kv, dtype=torch.bool, device=device).tril(shift)


def _attend(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, dropout_p: float,
            scale: float) -> Tensor:
    """``softmax(scale * q @ k^T + bias, over the kept cells) @ v`` on [B, N, S, D] tensors, by torch's own
    ``scaled_dot_product_attention``; key/value heads are repeated up to the query's (GQA). ``keep``: True = attends
    (broadcast to [B, N, Sq, Skv]); a query that attends to no key gets zeros."""
    if q.shape[1] != k.shape[1]:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"npu_fusion_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} "
                             "key/value heads")
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    mask = keep
    if bias is not None:
        mask = bias if keep is None else torch.where(keep, bias, torch.full((), float("-inf"), dtype=bias.dtype,
                                                                            device=bias.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def _softmax_stats(q: Tensor, k: Tensor, keep: Tensor | None, bias: Tensor | None,
                   scale: float) -> tuple[Tensor, Tensor]:
    """The vendor's softmax statistics of [B, N, Sq, Skv] scores, per query row, fp32: the maximum of the scaled,
    biased scores over the kept cells, and the sum of exp(score - maximum). A row with no kept cell: -inf and 0."""
    with torch.no_grad():  # the vendor's statistics carry no gradient
        if q.shape[1] != k.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = q.float() @ k.float().transpose(-1, -2) * scale
        if bias is not None:
            scores = scores + bias.float()
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        peak = scores.amax(-1)
        shift = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        return peak, torch.exp(scores - shift.unsqueeze(-1)).sum(-1)


_LIB.impl("npu_fusion_attention", _npu_fusion_attention, "CompositeImplicitAutograd")


# -- npu_rms_norm --------------------------------------------------------------------------------------------------

_LIB.define("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)")


def _npu_rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``x * rsqrt(mean(x**2) + eps) * gamma`` over the trailing ``gamma.dim()`` dimensions.

    Returns ``(y, rstd)``: ``y`` in ``x``'s dtype, ``rstd`` fp32 of shape ``x.shape[:-k] + (1,)*k``."""
    op = "npu_rms_norm"
    _on_npu(op, self=x, gamma=gamma)
    _float_dtype(op, "self", x)
    _float_dtype(op, "gamma", gamma)
    if gamma.dtype != x.dtype and gamma.dtype != torch.float32:
        raise TypeError(f"{op}: gamma must have self's dtype ({x.dtype}) or float32, got {gamma.dtype}")
    if not 1 <= x.dim() <= 8:
        raise ValueError(f"{op}: self must have 1 to 8 dimensions, got {x.dim()}")
    k = gamma.dim()
    if k < 1 or k > x.dim() or tuple(gamma.shape) != tuple(x.shape[-k:]):
        raise ValueError(f"{op}: gamma of shape {tuple(gamma.shape)} must match the trailing dimensions of self "
                         f"{tuple(x.shape)}")
    xf = x.float()  # computed in fp32, written in x's dtype
    rstd = torch.rsqrt(xf.pow(2).mean(tuple(range(-k, 0)), keepdim=True) + epsilon)  # x.shape[:-k] + (1,) * k
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y, rstd.detach()  # the statistic the vendor saves for its backward; not differentiable


_LIB.impl("npu_rms_norm", _npu_rms_norm, "CompositeImplicitAutograd")


# -- npu_swiglu ----------------------------------------------------------------------------------------------------

_LIB.define("npu_swiglu(Tensor self, int dim=-1) -> Tensor")


def _npu_swiglu(x: Tensor, dim: int = -1) -> Tensor:
    """``silu(a) * b`` for ``a, b = x.chunk(2, dim)`` (``a`` the first half). The vendor takes 1-8 dimensions,
    fp32/fp16/bf16, contiguous, non-empty input with an even split dimension; the output is contiguous."""
    op = "npu_swiglu"
    _on_npu(op, self=x)
    _float_dtype(op, "self", x)
    if not 1 <= x.dim() <= 8:
        raise ValueError(f"{op}: self must have 1 to 8 dimensions, got {x.dim()}")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"{op}: dim {dim} is out of range [{-x.dim()}, {x.dim() - 1}]")
    if not x.is_contiguous():
        raise RuntimeError(f"{op}: self must be contiguous (the vendor kernel does not take strided input); "
                           "call .contiguous() first")
    if x.numel() == 0:
        raise RuntimeError(f"{op}: self is empty, which the vendor kernel does not take")
    dim %= x.dim()
    if x.shape[dim] % 2:
        raise RuntimeError(f"{op}: dimension {dim} of self has odd size {x.shape[dim]}; it must split in two halves")
    a, b = x.chunk(2, dim)  # a, the first half, goes through SiLU
    return (F.silu(a.float()) * b.float()).to(x.dtype).contiguous()


_LIB.impl("npu_swiglu", _npu_swiglu, "CompositeImplicitAutograd")


# -- npu_rotary_mul ------------------------------------------------------------------------------------------------

_LIB.define("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor")


def _npu_rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    """``r1 * x + r2 * rotate(x)`` over the whole last dimension: ``half``: rotate = cat(-x2, x1);
    ``interleave``: each pair (x0, x1) -> (-x1, x0). 4-D ``x`` (BNSD/BSND/SBND), ``r1``/``r2`` 4-D and
    broadcastable to it (11SD, 1S1D, S11D, ...). Differentiable in ``x``, ``r1`` and ``r2``."""
    op = "npu_rotary_mul"
    _on_npu(op, self=x, r1=r1, r2=r2)
    for name, t in (("self", x), ("r1", r1), ("r2", r2)):
        _float_dtype(op, name, t)
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D, got shape {tuple(t.shape)}")
    if rotary_mode not in ("half", "interleave"):
        raise ValueError(f"{op}: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if r1.shape != r2.shape or r1.shape[-1] != x.shape[-1] or x.shape[-1] % 2:
        raise ValueError(f"{op}: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must share a shape whose last "
                         f"dimension is self's (even) head size {x.shape[-1]}")
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, -1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:  # each pair (x0, x1) -> (-x1, x0)
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return (r1.float() * x.float() + r2.float() * rotated.float()).to(x.dtype)


_LIB.impl("npu_rotary_mul", _npu_rotary_mul, "CompositeImplicitAutograd")


# -- npu_apply_adam_w ----------------------------------------------------------------------------------------------

_ADAM_W_ARGS = ("Scalar beta1_power, Scalar beta2_power, Scalar lr, Scalar weight_decay, Scalar beta1, Scalar beta2, "
                "Scalar epsilon, Tensor grad, Tensor? max_grad_norm, bool? amsgrad, bool? maximize")
_LIB.define(f"npu_apply_adam_w({_ADAM_W_ARGS}) -> (Tensor, Tensor, Tensor)")
_LIB.define(f"npu_apply_adam_w.out({_ADAM_W_ARGS}, *, Tensor(a!) var, Tensor(b!) m, Tensor(c!) v) "
            "-> (Tensor(a!), Tensor(b!), Tensor(c!))")


def _adam_w_functional(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
    raise RuntimeError("npu_apply_adam_w is not implemented for Tensor: pass out=(var, m, v), which it updates "
                       "in place")


@torch.no_grad()
def _adam_w_out(beta1_power: float, beta2_power: float, lr: float, weight_decay: float, beta1: float, beta2: float,
                epsilon: float, grad: Tensor, max_grad_norm: Tensor | None, amsgrad: bool | None,
                maximize: bool | None, *, var: Tensor, m: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One AdamW step in place, in the vendor's arithmetic (op-plugin docs and its CPU reference):

    ``g = -grad if maximize``; ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
    ``denom = sqrt(v' / (1 - beta2_power*b2)) + eps`` with ``v' = max(max_grad_norm, v)`` under amsgrad;
    ``var = var*(1 - lr*wd) - lr * m / (1 - beta1_power*b1) / denom``.

    The kernel multiplies the powers by beta once more, so step t passes ``beta1**(t-1)``/``beta2**(t-1)``
    (1.0 at the first step). ``max_grad_norm`` is read, not written (its schema is not mutable): amsgrad callers
    keep the running maximum themselves. Computed in fp32 and written back in the tensors' dtype.
    """
    op = "npu_apply_adam_w"
    _on_npu(op, grad=grad, max_grad_norm=max_grad_norm, var=var, m=m, v=v)
    for name, t in (("grad", grad), ("var", var), ("m", m), ("v", v)):
        _float_dtype(op, name, t)
        if t.shape != var.shape:
            raise ValueError(f"{op}: var, m, v and grad must share a shape, got {name} {tuple(t.shape)} and var "
                             f"{tuple(var.shape)}")
    if amsgrad and max_grad_norm is None:
        raise RuntimeError(f"{op}: if amsgrad is true, max_grad_norm input must be entered")
    if max_grad_norm is not None and amsgrad and max_grad_norm.shape != var.shape:
        raise ValueError(f"{op}: max_grad_norm must have var's shape {tuple(var.shape)}")
    g = grad.float()
    if maximize:
        g = -g
    mf, vf, pf = m.float(), v.float(), var.float()
    mf.mul_(beta1).add_(g, alpha=1.0 - beta1)
    vf.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    pf.mul_(1.0 - lr * weight_decay)
    bc1, bc2 = 1.0 - beta1_power * beta1, 1.0 - beta2_power * beta2
    second = torch.maximum(max_grad_norm.float(), vf) if amsgrad else vf
    denom = (second / bc2).sqrt_().add_(epsilon)
    pf.addcdiv_(mf, denom, value=-lr / bc1)
    for target, value in ((m, mf), (v, vf), (var, pf)):
        if target is not value:
            target.copy_(value)
    return var, m, v


_LIB.impl("npu_apply_adam_w", _adam_w_functional, "CompositeExplicitAutograd")
_LIB.impl("npu_apply_adam_w.out", _adam_w_out, "CompositeExplicitAutograd")


# -- npu_grouped_matmul --------------------------------------------------------------------------------------------

# Ascend's torch_npu API reference (PyTorch 2.1+ builds): one operator, group_list a tensor or an int list
_GMM_ARGS = ("Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, Tensor[]? offset=None, "
             "Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, "
             "{group_list}, Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None, "
             "Tensor[]? activation_quant_offset=None, int? split_item=0, int? group_type=-1, int? group_list_type=0, "
             "int? act_type=0, ScalarType? output_dtype=None")
_LIB.define(f"npu_grouped_matmul({_GMM_ARGS.format(group_list='Tensor? group_list=None')}) -> Tensor[]")
_LIB.define(f"npu_grouped_matmul.List({_GMM_ARGS.format(group_list='int[]? group_list=None')}) -> Tensor[]")


def _gmm_counts(group_list: Tensor | Sequence[int] | None, group_list_type: int, total: int, axis: str) -> list[int]:
    """Per-group sizes along ``axis`` from ``group_list``: cumulative ends (type 0) or counts (type 1)."""
    op = "npu_grouped_matmul"
    if group_list is None:
        raise ValueError(f"{op}: splitting a single x along {axis} needs group_list")
    values = [int(v) for v in (group_list.tolist() if isinstance(group_list, Tensor) else group_list)]
    if group_list_type == 0:
        counts = [end - start for start, end in zip([0, *values[:-1]], values, strict=True)]
    elif group_list_type == 1:
        counts = values
    else:
        raise ValueError(f"{op}: group_list_type must be 0 (cumulative) or 1 (counts), got {group_list_type}")
    if any(c < 0 for c in counts) or sum(counts) != total:
        raise ValueError(f"{op}: group_list {values} (group_list_type={group_list_type}) must split the {total} "
                         f"entries of x's {axis} axis into non-negative groups")
    return counts


def _npu_grouped_matmul(x: Sequence[Tensor], weight: Sequence[Tensor], *, bias: Sequence[Tensor] | None = None,
                        scale: Sequence[Tensor] | None = None, offset: Sequence[Tensor] | None = None,
                        antiquant_scale: Sequence[Tensor] | None = None,
                        antiquant_offset: Sequence[Tensor] | None = None,
                        per_token_scale: Sequence[Tensor] | None = None,
                        group_list: Tensor | Sequence[int] | None = None,
                        activation_input: Sequence[Tensor] | None = None,
                        activation_quant_scale: Sequence[Tensor] | None = None,
                        activation_quant_offset: Sequence[Tensor] | None = None, split_item: int | None = 0,
                        group_type: int | None = -1, group_list_type: int | None = 0, act_type: int | None = 0,
                        output_dtype: torch.dtype | None = None) -> list[Tensor]:
    """Grouped matmuls, unquantized: ``group_type`` -1 pairs ``x[i]`` with ``weight[i]``; 0 splits the rows (M) of
    a single ``x`` by ``group_list`` (or takes one ``x`` per group) against one [G, K, N] weight or G [K, N] ones;
    2 splits the contraction axis (K) of a single ``x`` [M, K] and ``weight`` [K, N], group g giving
    ``x[:, k_g] @ weight[k_g]``. ``split_item`` 0/1 return one tensor per group; 2/3 one tensor: the row groups
    concatenated (-1, 0) or the K groups stacked to [G, M, N] (2). Products summed in fp32, written in x's dtype;
    ``bias`` (one [N] per group) added. Quantization, activations and ``group_type`` 1 (which the vendor does not
    take either) are refused. Not differentiable: callers write the backward with this op, as MoE code does."""
    op = "npu_grouped_matmul"
    unemulated = {"scale": scale, "offset": offset, "antiquant_scale": antiquant_scale,
                  "antiquant_offset": antiquant_offset, "per_token_scale": per_token_scale,
                  "activation_input": activation_input, "activation_quant_scale": activation_quant_scale,
                  "activation_quant_offset": activation_quant_offset}
    given = sorted(name for name, value in unemulated.items() if value)
    if given or act_type or (output_dtype is not None and x and output_dtype != x[0].dtype):
        asked = ", ".join(given + (["act_type"] if act_type else []) + (["output_dtype"] if output_dtype else []))
        raise NotImplementedError(f"{op}: quantized or fused-activation grouped matmul ({asked}) is not emulated")
    if not x or not weight:
        raise ValueError(f"{op}: x and weight must each hold at least one tensor")
    tensors = {f"x[{i}]": t for i, t in enumerate(x)} | {f"weight[{i}]": t for i, t in enumerate(weight)}
    tensors |= {f"bias[{i}]": t for i, t in enumerate(bias or ())}
    _on_npu(op, **tensors, group_list=group_list if isinstance(group_list, Tensor) else None)
    dtype = x[0].dtype
    for name, t in tensors.items():
        if not name.startswith("bias"):
            _float_dtype(op, name, t)
            if t.dtype != dtype:
                raise TypeError(f"{op}: x and weight must share a dtype, got {dtype} and {t.dtype} ({name})")
    kind = -1 if group_type is None else group_type
    split = split_item or 0
    if split not in (0, 1, 2, 3):
        raise ValueError(f"{op}: split_item must be 0..3, got {split_item}")
    gl_type = group_list_type or 0

    def product(a: Tensor, w: Tensor, g: int) -> Tensor:
        out = a.float() @ w.float()
        if bias:
            out = out + bias[g].float()
        return out.to(dtype)

    if kind == 2:  # the contraction axis split: one x [M, K], one weight [K, N] -> per group [M, N]
        if len(x) != 1 or len(weight) != 1 or x[0].dim() != 2 or weight[0].dim() != 2:
            raise ValueError(f"{op}: group_type=2 takes one 2-D x [M, K] and one 2-D weight [K, N]")
        a, w = x[0], weight[0]
        if a.shape[1] != w.shape[0]:
            raise ValueError(f"{op}: x {tuple(a.shape)} and weight {tuple(w.shape)} do not share K")
        counts = _gmm_counts(group_list, gl_type, a.shape[1], "K")
        outs = [product(a_g, w_g, g) for g, (a_g, w_g) in
                enumerate(zip(torch.split(a, counts, dim=1), torch.split(w, counts, dim=0), strict=True))]
        return [torch.stack(outs)] if split in (2, 3) else outs
    if kind not in (-1, 0):
        raise ValueError(f"{op}: group_type must be -1, 0 or 2 (1, the N axis, is not supported), got {group_type}")
    weights = list(weight[0].unbind(0)) if len(weight) == 1 and weight[0].dim() == 3 else list(weight)
    if any(w.dim() != 2 for w in weights):
        raise ValueError(f"{op}: weight must be one 3-D [G, K, N] tensor or 2-D [K, N] tensors")
    if kind == 0 and len(x) == 1 and group_list is not None:
        if x[0].dim() != 2:
            raise ValueError(f"{op}: a single x split by group_list must be 2-D [M, K], got {tuple(x[0].shape)}")
        inputs = list(torch.split(x[0], _gmm_counts(group_list, gl_type, x[0].shape[0], "M"), dim=0))
    else:
        inputs = list(x)
    if len(inputs) != len(weights):
        raise ValueError(f"{op}: {len(inputs)} groups of x for {len(weights)} weights")
    if bias and len(bias) != len(weights):
        raise ValueError(f"{op}: {len(bias)} biases for {len(weights)} weights")
    for i, (a, w) in enumerate(zip(inputs, weights, strict=True)):
        if a.shape[-1] != w.shape[0]:
            raise ValueError(f"{op}: group {i}: x {tuple(a.shape)} and weight {tuple(w.shape)} do not share K")
    outs = [product(a, w, g) for g, (a, w) in enumerate(zip(inputs, weights, strict=True))]
    if split in (2, 3):
        return [torch.cat([o.reshape(-1, o.shape[-1]) for o in outs])]
    return outs


_LIB.impl("npu_grouped_matmul", _npu_grouped_matmul, "CompositeExplicitAutograd")
_LIB.impl("npu_grouped_matmul.List", _npu_grouped_matmul, "CompositeExplicitAutograd")


# -- the torch_npu.* spellings -------------------------------------------------------------------------------------

npu_fusion_attention = torch.ops.npu.npu_fusion_attention
npu_rms_norm = torch.ops.npu.npu_rms_norm
npu_swiglu = torch.ops.npu.npu_swiglu
npu_rotary_mul = torch.ops.npu.npu_rotary_mul
npu_grouped_matmul = torch.ops.npu.npu_grouped_matmul


def npu_apply_adam_w(beta1_power: float, beta2_power: float, lr: float, weight_decay: float, beta1: float,
                     beta2: float, epsilon: float, grad: Tensor, max_grad_norm: Tensor | None = None,
                     amsgrad: bool | None = None, maximize: bool | None = None, *,
                     out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``torch_npu.npu_apply_adam_w(..., out=(var, m, v))``: see ``torch.ops.npu.npu_apply_adam_w.out``."""
    args = (beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad, max_grad_norm, amsgrad, maximize)
    if out is None:
        return torch.ops.npu.npu_apply_adam_w.default(*args)
    if len(out) != 3:
        raise RuntimeError(f"npu_apply_adam_w: expected tuple of 3 elements but got {len(out)}")
    var, m, v = out
    return torch.ops.npu.npu_apply_adam_w.out(*args, var=var, m=m, v=v)


__all__ = ["COMPRESSED_MASK_SIZE", "npu_apply_adam_w", "npu_fusion_attention", "npu_grouped_matmul", "npu_rms_norm",
           "npu_rotary_mul", "npu_swiglu"]
