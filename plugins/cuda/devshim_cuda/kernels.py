"""The cuda plugin's attention and fused ops: devshim's conventions (``devshim_core.records.FusedKernels``) on
torch's own implementations, ``F.scaled_dot_product_attention``, ``F.rms_norm``, ``F.silu`` and plain tensor ops.

Independent of ``devshim_kernels``' compute (the conformance kit compares the two): only its layout views
(``devshim_kernels.layouts``, reshapes and transposes) are shared. Everything here is plain torch, so it runs, and
is tested, on CPU tensors too; on a GPU, SDPA picks flash, memory-efficient or cuDNN attention itself.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from devshim_kernels.layouts import LAYOUTS, from_bnsd, to_bnsd

Tensor = torch.Tensor
MASKED_FILL = -10000.0  # Megatron's fill for masked scores, fused and unfused
_ALIGNMENTS = ("top_left", "bottom_right")


# -- attention -----------------------------------------------------------------------------------------------------

def attention(q: Tensor, k: Tensor, v: Tensor, *, layout: str = "BNSD", num_heads: int | None = None,
              attn_mask: Tensor | None = None, mask_true_means_masked: bool = False, causal: bool = False,
              dropout_p: float = 0.0, scale: float | None = None, cu_seqlens_q: Any = None, cu_seqlens_kv: Any = None,
              causal_alignment: str = "top_left") -> Tensor:
    """Scaled dot-product attention with devshim's conventions, the output in ``q``'s layout.

    Layouts ``BNSD``, ``BSND``, ``BSH``/``SBH`` (``num_heads`` = query heads) and packed ``TND`` (``cu_seqlens_q``/
    ``cu_seqlens_kv``, with or without the leading 0). A boolean or integer mask keeps ``True`` (non-zero) unless
    ``mask_true_means_masked``; a floating mask is added to the scores. ``causal_alignment`` ``top_left`` (SDPA) or
    ``bottom_right`` (flash-attn). Grouped-query key/value heads divide the query heads. A query that may attend to
    no key gets zeros, with zero gradient."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    if layout == "TND":
        if attn_mask is not None:
            raise ValueError("layout TND takes no attn_mask: cu_seqlens_q/cu_seqlens_kv separate the sequences")
        if cu_seqlens_q is None:
            raise ValueError("layout TND needs cu_seqlens_q")
        if num_heads is not None and q.dim() == 3 and q.shape[1] != num_heads:
            raise ValueError(f"num_heads={num_heads} but q in layout TND has {q.shape[1]} heads")
        return _packed(q, k, v, cu_seqlens_q, cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv, causal,
                       causal_alignment, dropout_p, scale)
    qb, kb, vb = _bnsd_views(q, k, v, layout, num_heads)
    mask = _sdpa_mask(attn_mask, mask_true_means_masked)
    return from_bnsd(_sdpa(qb, kb, vb, mask, causal, causal_alignment, dropout_p, scale), layout)


def _bnsd_views(q: Tensor, k: Tensor, v: Tensor, layout: str, num_heads: int | None) -> tuple[Tensor, Tensor, Tensor]:
    if layout in ("BSH", "SBH"):
        if num_heads is None:
            raise ValueError(f"layout {layout} needs num_heads")
        if q.dim() != 3 or q.shape[-1] % num_heads:
            raise ValueError(f"q of shape {tuple(q.shape)} in layout {layout} does not hold {num_heads} heads")
        head_dim = q.shape[-1] // num_heads
        kb = to_bnsd(k, layout, head_dim)
        return to_bnsd(q, layout, head_dim), kb, to_bnsd(v, layout, v.shape[-1] // kb.shape[1])
    qb = to_bnsd(q, layout)
    if num_heads is not None and qb.shape[1] != num_heads:
        raise ValueError(f"num_heads={num_heads} but q in layout {layout} has {qb.shape[1]} heads")
    return qb, to_bnsd(k, layout), to_bnsd(v, layout)


def _sdpa_mask(attn_mask: Tensor | None, true_means_masked: bool) -> Tensor | None:
    """The mask as SDPA reads it: boolean ``True`` = attend, or a floating bias."""
    if attn_mask is None or attn_mask.is_floating_point():
        return attn_mask
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask != 0
    return ~keep if true_means_masked else keep


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, alignment: str, dropout_p: float,
          scale: float | None) -> Tensor:
    """Attention over [B, N, S, D] tensors; ``mask`` keep-boolean or additive, broadcastable to [B, N, Sq, Skv]."""
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not describe one attention")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    s_q, s_k = q.shape[-2], k.shape[-2]
    if mask is not None:
        if mask.dim() > 4:
            raise ValueError(f"attn_mask of shape {tuple(mask.shape)} has more than 4 dimensions")
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mask.is_floating_point() and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)  # SDPA takes a bias only in the query's dtype
    if causal and (mask is not None or (alignment == "bottom_right" and s_q != s_k)):
        # SDPA's is_causal is top-left and excludes a mask: fold the triangle into one
        allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(
            s_k - s_q if alignment == "bottom_right" else 0)
        if mask is None:
            mask = allowed
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.masked_fill(~allowed, float("-inf"))
        causal = False
    empty = None
    if mask is not None and mask.dtype == torch.bool:
        # a query row with no key to attend to: let it attend to all (finite, whatever the backend does with an
        # all-masked row) and write zeros for it, which also zeroes every gradient flowing through it
        empty = ~mask.any(dim=-1, keepdim=True)
        mask = mask | empty
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out if empty is None else out.masked_fill(empty, 0.0)


def seq_lengths(cu_seqlens: Tensor | Sequence[int], total: int, name: str) -> list[int]:
    """Per-sequence lengths from cumulative lengths with ([0, 2, 5]) or without ([2, 5]) the leading 0."""
    ends = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if not ends:
        raise ValueError(f"{name} is empty")
    offsets = ends if ends[0] == 0 else [0, *ends]
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing cumulative lengths, got {offsets}")
    if offsets[-1] != total:
        raise ValueError(f"{name} ends at {offsets[-1]} but the tensor holds {total} tokens")
    return lengths


def _packed(q: Tensor, k: Tensor, v: Tensor, cu_q: Any, cu_kv: Any, causal: bool, alignment: str, dropout_p: float,
            scale: float | None) -> Tensor:
    """Packed [tokens, heads, dim] attention, each sequence attending only within itself."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"layout TND expects 3-D q/k/v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k holds {k.shape[0]} tokens but v {v.shape[0]}")
    len_q = seq_lengths(cu_q, q.shape[0], "cu_seqlens_q")
    len_kv = seq_lengths(cu_kv, k.shape[0], "cu_seqlens_kv")
    if len(len_q) != len(len_kv):
        raise ValueError(f"cu_seqlens_q describes {len(len_q)} sequences but cu_seqlens_kv {len(len_kv)}")

    def run(qs: Tensor, ks: Tensor, vs: Tensor) -> Tensor:  # [B, S, N, D] in and out
        bnsd = _sdpa(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), None, causal, alignment, dropout_p,
                     scale)
        return bnsd.transpose(1, 2)

    if len(set(len_q)) == 1 and len(set(len_kv)) == 1 and len_q[0] and len_kv[0]:  # equal lengths: one batch
        b = len(len_q)
        return run(q.unflatten(0, (b, -1)), k.unflatten(0, (b, -1)), v.unflatten(0, (b, -1))).flatten(0, 1)
    pieces = []
    for qs, ks, vs in zip(q.split(len_q), k.split(len_kv), v.split(len_kv), strict=True):
        if qs.shape[0] and ks.shape[0]:
            pieces.append(run(qs[None], ks[None], vs[None])[0])
        else:  # no queries, or no keys for them: zeros
            pieces.append(qs.new_zeros(qs.shape[0], qs.shape[1], v.shape[-1]))
    return torch.cat(pieces)


# -- fused ops -----------------------------------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, on ``F.rms_norm`` (statistics in fp32, fp64
    for fp64 input). A weight of another dtype multiplies the normalised value afterwards, so the result has ``x``'s
    dtype promoted with the weight's."""
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match the last dimension of {tuple(x.shape)}")
    shape = (x.shape[-1],)
    if weight is None or weight.dtype == x.dtype:
        return F.rms_norm(x, shape, weight, eps)
    return F.rms_norm(x, shape, None, eps) * weight


def swiglu(x: Tensor) -> Tensor:
    """``silu(a) * b`` for ``a, b = x.chunk(2, -1)``."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension, got {x.shape[-1]}")
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """``x * cos + rotate(x) * sin`` over the first ``cos.shape[-1]`` channels, the rest passed through; half
    rotation ``(-x2, x1)`` or interleaved pairs ``(x0, x1) -> (-x1, x0)``; in ``x``'s dtype."""
    rot = cos.shape[-1]
    if sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"cannot rotate {rot} of the {x.shape[-1]} channels: need an even count that fits")
    try:
        fits = torch.broadcast_shapes(cos.shape[:-1], x.shape[:-1]) == x.shape[:-1]
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"cos/sin of shape {tuple(cos.shape)} do not broadcast to x of shape {tuple(x.shape)}")
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    part = x[..., :rot]
    if interleaved:
        turned = torch.stack((-part[..., 1::2], part[..., 0::2]), dim=-1).flatten(-2)
    else:
        first, second = part.chunk(2, dim=-1)
        turned = torch.cat((-second, first), dim=-1)
    rotated = part * cos + turned * sin
    return rotated if rot == x.shape[-1] else torch.cat((rotated, x[..., rot:]), dim=-1)


def masked_softmax(scores: Tensor, mask: Tensor | None, scale: float, *, causal: bool = False) -> Tensor:
    """``softmax(scores * scale)`` over the last dimension of [b, np, sq, sk] scores, masked positions (``True``, or
    non-zero) filled with -10000.0 after scaling; ``causal`` also masks key j > query i. A row with every position
    masked is zeros. Computed in fp32 (fp64 for fp64 scores), returned in the scores' dtype."""
    if scores.dim() != 4:
        raise ValueError(f"masked_softmax expects [b, np, sq, sk] scores, got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"masked_softmax expects floating scores, got {scores.dtype}")
    masked = None
    if mask is not None:
        if mask.is_floating_point():
            raise ValueError("masked_softmax takes a boolean mask (True = masked), not an additive float mask")
        try:
            fits = torch.broadcast_shapes(mask.shape, scores.shape) == scores.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to scores {tuple(scores.shape)}")
        masked = mask if mask.dtype == torch.bool else mask != 0
    if causal:
        s_q, s_k = scores.shape[-2:]
        upper = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(1)
        masked = upper if masked is None else masked | upper
    compute = torch.float64 if scores.dtype == torch.float64 else torch.float32
    x = scores.to(compute) * scale
    if masked is not None:
        x = x.masked_fill(masked, MASKED_FILL)
    probs = torch.softmax(x, dim=-1)
    if masked is not None:
        probs = probs.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)
    return probs.to(scores.dtype)


def wgrad_accumulate(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` in place, leading dimensions flattened; products summed in fp32
    (fp64 if any operand is fp64) and the sum added to ``main_grad`` with one rounding to its dtype."""
    x = total_input.reshape(-1, total_input.shape[-1])
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"total_input {tuple(total_input.shape)} and grad_output {tuple(grad_output.shape)} hold "
                         "different numbers of tokens")
    if tuple(main_grad.shape) != (dy.shape[1], x.shape[1]):
        raise ValueError(f"main_grad of shape {tuple(main_grad.shape)} is not [out, in] = [{dy.shape[1]}, "
                         f"{x.shape[1]}]")
    acc = torch.float64 if torch.float64 in (x.dtype, dy.dtype, main_grad.dtype) else torch.float32
    with torch.no_grad():
        if x.dtype == dy.dtype == acc and main_grad.dtype == acc:
            main_grad.addmm_(dy.t(), x)
            return
        product = None
        if main_grad.device.type == "cuda" and acc == torch.float32 and x.dtype == dy.dtype != acc:
            try:  # torch >= 2.8 on CUDA: fp16/bf16 GEMM with an fp32 result, no fp32 copies of the operands
                product = torch.mm(dy.t(), x, out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):
                product = None
        if product is None:
            product = torch.mm(dy.t().to(acc), x.to(acc))
        main_grad.add_(product)  # computed in fp32, rounded once to main_grad's dtype


# -- fused Adam ----------------------------------------------------------------------------------------------------

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def fused_adamw(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, adamw_mode: bool = True, bias_correction: bool = True,
                max_exp_avg_sqs: Sequence[Tensor] | None = None,
                param_copies: Sequence[Tensor | None] | None = None) -> None:
    """Adam/AdamW over lists of tensors, in place, as ``torch.optim.AdamW``/``Adam`` (``step`` counts from 1).

    Tensors of one dtype and device, contiguous, with bias correction, run torch's multi-tensor kernel
    (``torch._fused_adamw_``/``torch._fused_adam_``, amsgrad included); the rest (no bias correction, mixed dtypes,
    strided tensors) take the update written out in fp32 (fp64 for fp64) and rounded once into each tensor. Each
    ``param_copies`` entry (bf16/fp16, or ``None``) receives its updated param afterwards, converted by ``copy_``."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (the number of this update), got {step}")
    count = len(params)
    lists: dict[str, Sequence[Tensor | None]] = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if max_exp_avg_sqs is not None:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    if param_copies is not None:
        lists["param_copies"] = param_copies
    for name, values in lists.items():
        if len(values) != count:
            raise ValueError(f"{len(values)} {name} for {count} params")
    maxima: list[Tensor | None] = list(max_exp_avg_sqs) if max_exp_avg_sqs is not None else [None] * count
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    written: list[int] = []
    for i in range(count):
        p, g, m, v, mx = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], maxima[i]
        if not (g.numel() == m.numel() == v.numel() == p.numel() and (mx is None or mx.numel() == p.numel())):
            raise ValueError(f"tensor {i}: grad, exp_avg, exp_avg_sq (and max_exp_avg_sq) must have the param's "
                             f"{p.numel()} elements")
        if p.numel() == 0:
            continue
        written.append(i)
        tensors = [t for t in (p, g, m, v, mx) if t is not None]
        if bias_correction and p.dtype in _FUSED_DTYPES and all(
                t.dtype == p.dtype and t.device == p.device and t.shape == p.shape and t.is_contiguous()
                for t in tensors):
            groups.setdefault((p.device, p.dtype), []).append(i)
        else:
            _step_written_out(p, g, m, v, mx, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction)
    amsgrad = max_exp_avg_sqs is not None
    kernel = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    with torch.no_grad():
        for (device, _), members in groups.items():
            step_tensor = torch.full((), float(step), dtype=torch.float32, device=device)
            kernel([params[i] for i in members], [grads[i] for i in members], [exp_avgs[i] for i in members],
                   [exp_avg_sqs[i] for i in members],
                   cast("list[Tensor]", [maxima[i] for i in members]) if amsgrad else [],  # tensors where amsgrad
                   [step_tensor] * len(members), lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                   amsgrad=amsgrad, maximize=False)
        if param_copies is not None:
            for i in written:
                copy = param_copies[i]
                if copy is not None:
                    copy.copy_(params[i].reshape(copy.shape))


def _step_written_out(p: Tensor, g: Tensor, m: Tensor, v: Tensor, mx: Tensor | None, *, step: int, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
                      bias_correction: bool) -> None:
    """One tensor's update in fp32 (fp64 for fp64 params), each state and the param rounded once into place."""
    compute = torch.float64 if p.dtype == torch.float64 else torch.float32

    def work(t: Tensor) -> Tensor:  # a private fp32 copy, flat
        return t.detach().reshape(-1).to(compute, copy=True)

    with torch.no_grad():
        pf, gf, mf, vf = work(p), work(g), work(m), work(v)
        if weight_decay and not adamw_mode:
            gf.add_(pf, alpha=weight_decay)
        mf.mul_(beta1).add_(gf, alpha=1.0 - beta1)
        vf.mul_(beta2).addcmul_(gf, gf, value=1.0 - beta2)
        bc1, bc2 = (1.0 - beta1 ** step, 1.0 - beta2 ** step) if bias_correction else (1.0, 1.0)
        if weight_decay and adamw_mode:
            pf.mul_(1.0 - lr * weight_decay)
        second = vf
        if mx is not None:
            second = torch.maximum(work(mx), vf)
            mx.copy_(second.view(mx.shape))
        denom = (second.sqrt() / math.sqrt(bc2)).add_(eps)
        pf.addcdiv_(mf, denom, value=-lr / bc1)
        for target, value in ((p, pf), (m, mf), (v, vf)):
            target.copy_(value.view(target.shape))
