"""The Ascend plugin's kernels: devshim's PyTorch conventions (``devshim_core.records``) on torch_npu's ops.

Imported only once the plugin is selected, so ``torch_npu`` is importable. Each op converts devshim's conventions
to the vendor's (mask polarity, explicit scale, causal sparse modes, cumulative lengths without the leading 0)
and answers with ``devshim_kernels`` what the vendor op cannot take (additive masks, other dtypes, shapes outside
the kernel's constraints), so callers never see a vendor limitation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import devshim_kernels as dk
import devshim_kernels.attention_lse as dk_lse
import torch
import torch_npu
from devshim_kernels.grouped import group_sizes_list

from devshim_core import FusedKernels, OptimizerKernels, host_defaults

if TYPE_CHECKING:
    from devshim_kernels.attention import CausalAlignment

Tensor = torch.Tensor
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_COMPRESSED = 2048  # npu_fusion_attention's causal modes take this triu mask whatever the sequence length
_SEQ_DIM = {"BNSD": 2, "BSND": 1, "BSH": 1, "SBH": 0}


@functools.lru_cache(maxsize=16)
def _compressed_causal_mask(device: torch.device) -> Tensor:
    """The mask sparse_mode 2/3 require (built once per device, as MindSpeed does)."""
    return torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device).triu_(1)


def _vendor_lengths(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    """Cumulative lengths in Ascend's spelling: no leading 0 ([0, 2, 5] and [2, 5] both give [2, 5])."""
    ends = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    return ends[1:] if len(ends) > 1 and ends[0] == 0 else ends


def _vendor_mask(mask: Tensor, b: int, n: int, s_q: int, s_kv: int) -> Tensor:
    """A mask broadcastable to [B, N, Sq, Skv] in a shape the vendor takes (SS, 11SS, B1SS, BNSS)."""
    if mask.dim() == 2 and tuple(mask.shape) == (s_q, s_kv):
        return mask
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    lead_b, lead_n = m.shape[0], m.shape[1]
    if lead_n != 1 and lead_b == 1:
        lead_b = b  # 1NSS is not among the vendor's shapes
    shape = (lead_b, lead_n, s_q, s_kv)
    return m if tuple(m.shape) == shape else m.expand(shape).contiguous()


def attention(q: Tensor, k: Tensor, v: Tensor, *, layout: str, num_heads: int | None = None,
              attn_mask: Tensor | None = None, mask_true_means_masked: bool = False, causal: bool = False,
              dropout_p: float = 0.0, scale: float | None = None, cu_seqlens_q: Any = None,
              cu_seqlens_kv: Any = None, causal_alignment: str = "top_left") -> Tensor:
    """devshim's ``attention`` on ``npu_fusion_attention``; float (additive) masks, dtypes other than
    fp32/fp16/bf16 and masked TND run ``devshim_kernels.attention`` (the vendor has no additive mask)."""
    reference = functools.partial(
        dk.attention, q, k, v, layout=layout, num_heads=num_heads, attn_mask=attn_mask,
        mask_true_means_masked=mask_true_means_masked, causal=causal, dropout_p=dropout_p, scale=scale,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
        causal_alignment=cast("CausalAlignment", causal_alignment))  # any other: passed on, for dk.attention to refuse
    if (layout not in dk.LAYOUTS or q.dtype not in _FLOATS or not q.dtype == k.dtype == v.dtype
            or (attn_mask is not None and (attn_mask.is_floating_point() or layout == "TND" or attn_mask.dim() > 4))
            or causal_alignment not in ("top_left", "bottom_right") or not 0.0 <= dropout_p < 1.0):
        return reference()  # devshim's own conventions (and its errors) for everything the vendor op cannot take
    if layout in ("BSH", "SBH"):
        if num_heads is None:
            raise ValueError(f"layout {layout} needs num_heads")
        head_num, head_dim = num_heads, q.shape[-1] // num_heads
    else:
        head_num = q.shape[1] if layout in ("BNSD", "TND") else q.shape[2]
        head_dim = q.shape[-1]
        if num_heads is not None and num_heads != head_num:
            raise ValueError(f"num_heads={num_heads} but q in layout {layout} has {head_num} heads")
    kwargs: dict[str, Any] = {"scale": 1.0 / math.sqrt(head_dim) if scale is None else scale,
                              "keep_prob": 1.0 - dropout_p}
    if layout == "TND":
        if cu_seqlens_q is None:
            raise ValueError("layout TND needs cu_seqlens_q")
        kwargs["actual_seq_qlen"] = _vendor_lengths(cu_seqlens_q)
        kwargs["actual_seq_kvlen"] = _vendor_lengths(cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv)
    mask = None
    if attn_mask is not None:  # boolean/integer: the vendor's True means masked out
        mask = attn_mask.bool() if mask_true_means_masked else ~attn_mask.bool()
        s_q, s_kv = q.shape[_SEQ_DIM[layout]], k.shape[_SEQ_DIM[layout]]
        batch = q.shape[1] if layout == "SBH" else q.shape[0]
        mask = _vendor_mask(mask, batch, head_num, s_q, s_kv)
        if causal:  # the causal modes read only the compressed mask: fold the triangle into the user's mask
            shift = s_kv - s_q if causal_alignment == "bottom_right" else 0
            mask = mask | torch.ones(s_q, s_kv, dtype=torch.bool, device=q.device).triu_(shift + 1)
    elif causal:
        mask = _compressed_causal_mask(q.device)
        kwargs["sparse_mode"] = 2 if causal_alignment == "top_left" else 3
    return torch_npu.npu_fusion_attention(q, k, v, head_num, layout, atten_mask=mask, **kwargs)[0]


def attention_lse(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                  mask_true_means_masked: bool = False, causal: bool = False, scale: float | None = None,
                  dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` from one ``npu_fusion_attention`` call in BNSD, as MindSpeed's ring attention reads it:
    ``lse = softmax_max + log(softmax_sum)`` (the vendor repeats each row's statistic 8 times). The vendor's
    statistics carry no gradient (its backward takes them as inputs), so ``lse``'s is recomputed from ``q`` and
    ``k`` (``devshim_kernels.attention_lse.with_lse_gradient``). ``devshim_kernels`` for what the op cannot take.
    Not verified on Ascend hardware: checked against the emulated op's statistics."""
    if (q.dim() != 4 or q.dtype not in _FLOATS or not q.dtype == k.dtype == v.dtype
            or (attn_mask is not None and (attn_mask.is_floating_point() or attn_mask.dim() > 4))
            or not 0.0 <= dropout_p < 1.0):
        return dk.attention_with_lse(q, k, v, attn_mask=attn_mask, mask_true_means_masked=mask_true_means_masked,
                                     causal=causal, scale=scale, dropout_p=dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    keep = dk_lse.keep_mask(attn_mask, mask_true_means_masked, causal, q.shape[2], k.shape[2], q.device)
    kwargs: dict[str, Any] = {"scale": scale, "keep_prob": 1.0 - dropout_p}  # dropout leaves the statistics alone
    if attn_mask is not None:
        kwargs["atten_mask"] = _vendor_mask(~cast("Tensor", keep), q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    elif causal:
        kwargs.update(atten_mask=_compressed_causal_mask(q.device), sparse_mode=2)
    out, softmax_max, softmax_sum = torch_npu.npu_fusion_attention(q, k, v, q.shape[1], "BNSD", **kwargs)[:3]
    peak, total = softmax_max[..., 0].detach(), softmax_sum[..., 0].detach()
    lse = torch.where(total > 0, peak + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return out, dk_lse.with_lse_gradient(lse, q, k, keep=keep, scale=scale)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """``npu_rms_norm(x, weight, eps)[0]`` (``weight=None``: ones); devshim's kernel where the vendor's dtypes or
    result dtype differ from devshim's convention (``x``'s dtype promoted with ``weight``'s)."""
    if weight is None:
        if x.dtype not in _FLOATS:
            return dk.rms_norm(x, None, eps)
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    if x.dtype not in _FLOATS or weight.dtype != x.dtype or weight.shape != x.shape[-1:] or x.dim() > 8:
        return dk.rms_norm(x, weight, eps)
    return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]


def swiglu(x: Tensor) -> Tensor:
    """``npu_swiglu(x, dim=-1)`` on a contiguous copy if needed (the vendor takes only contiguous input)."""
    if x.dtype not in _FLOATS or not 1 <= x.dim() <= 8 or x.numel() == 0 or x.shape[-1] % 2:
        return dk.swiglu(x)
    return torch_npu.npu_swiglu(x.contiguous(), dim=-1)


def rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """``npu_rotary_mul`` (``half``/``interleave``) on 4-D input; partial rotary rotates the first
    ``cos.shape[-1]`` channels with the vendor op and passes the rest through."""
    rot = cos.shape[-1]
    if (x.dim() != 4 or x.dtype not in _FLOATS or cos.dim() > 4 or sin.shape != cos.shape or rot % 2
            or rot > x.shape[-1] or torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1]) != x.shape[:-1]):
        return dk.rotary(x, cos, sin, interleaved=interleaved)
    lead = (1,) * (4 - cos.dim())
    r1, r2 = cos.to(x.dtype).reshape(lead + tuple(cos.shape)), sin.to(x.dtype).reshape(lead + tuple(sin.shape))
    mode = "interleave" if interleaved else "half"
    if rot == x.shape[-1]:
        return torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode=mode)
    turned = torch_npu.npu_rotary_mul(x[..., :rot].contiguous(), r1, r2, rotary_mode=mode)
    return torch.cat((turned, x[..., rot:]), dim=-1)


# torch_npu.npu_grouped_matmul, as verified against Ascend's torch_npu API reference (hiascend.com, "torch_npu.
# npu_grouped_matmul", PyTorch 2.1+ builds): npu_grouped_matmul(x: list[Tensor], weight: list[Tensor], *, bias=None,
# ..., group_list=None, split_item=0, group_type=None/-1, group_list_type=0, ...) -> list[Tensor]; group_type 0
# splits x's rows (M) by group_list, 2 splits the contraction axis (K); group_list_type 0 takes cumulative ends, 1
# per-group counts; split_item 2/3 return one tensor. Public MoE code on Ascend (MindSpeed-style GmmFunction) calls
# it so, with an autograd Function of its own for the backward: dx = gmm(dy, w^T) with group_type 0, and
# dw = gmm(x^T, dy) with group_type 2, split_item 3, giving [G, K, N]. The dispatcher spelling torch.ops.npu.* is the
# same operator as torch_npu.npu_grouped_matmul.
_GMM_MAX_GROUPS = 128  # the vendor's list limit; more groups run devshim_kernels' loop


def _npu_gmm(x: Tensor, weight: Tensor, group_list: Tensor, *, group_type: int, split_item: int) -> Tensor:
    out = torch.ops.npu.npu_grouped_matmul([x], [weight], group_list=group_list, split_item=split_item,
                                           group_type=group_type, group_list_type=1)
    return cast("Tensor", out[0])


class _GroupedMatmul(torch.autograd.Function):
    """``x`` [T, K] grouped by rows times ``weight`` [G, K, N]; both gradients by the vendor op too."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, group_list: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight, group_list)
        return _npu_gmm(x, weight, group_list, group_type=0, split_item=2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _npu_gmm(grad, weight.transpose(1, 2), group_list, group_type=0, split_item=2)
        if ctx.needs_input_grad[1]:
            dw = _npu_gmm(x.t(), grad, group_list, group_type=2, split_item=3)
        return dx, dw, None


def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor | Sequence[int], *, trans_b: bool = False) -> Tensor:
    """devshim's ``grouped_gemm`` on ``npu_grouped_matmul`` (counts as ``group_list``, an int64 tensor on the NPU);
    other dtypes, mixed dtypes, shapes other than [T, K] x [G, K, N] and more than 128 groups run
    ``devshim_kernels.grouped_gemm`` (which also raises devshim's errors for bad arguments)."""
    if (x.dim() != 2 or weight.dim() != 3 or x.dtype not in _FLOATS or weight.dtype != x.dtype
            or not 0 < weight.shape[0] <= _GMM_MAX_GROUPS or x.shape[0] == 0):
        return dk.grouped_gemm(x, weight, group_sizes, trans_b=trans_b)
    w = weight.transpose(1, 2) if trans_b else weight  # a view: the vendor takes transposed weights as they are
    if w.shape[1] != x.shape[1]:
        return dk.grouped_gemm(x, weight, group_sizes, trans_b=trans_b)  # its error names the shapes
    sizes = group_sizes_list(group_sizes, w.shape[0], x.shape[0])
    group_list = torch.tensor(sizes, dtype=torch.int64, device=x.device)
    return cast("Tensor", _GroupedMatmul.apply(x, w, group_list))


def fused_adamw(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, adamw_mode: bool = True, bias_correction: bool = True,
                max_exp_avg_sqs: Sequence[Tensor] | None = None,
                param_copies: Sequence[Tensor | None] | None = None) -> None:
    """Adam(W) step: ``npu_apply_adam_w`` per tensor for AdamW with bias correction; L2 Adam, no bias correction,
    amsgrad (not in every CANN build's kernel) and mixed dtypes run ``devshim_kernels.fused_adamw`` on the
    device."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (the number of this update), got {step}")
    vendor = adamw_mode and bias_correction and max_exp_avg_sqs is None
    rest: list[int] = []
    with torch.no_grad():
        for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
            if not (vendor and p.dtype in _FLOATS and g.dtype == m.dtype == v.dtype == p.dtype
                    and g.shape == m.shape == v.shape == p.shape):
                rest.append(i)
                continue
            # the kernel multiplies the powers by beta once more: step t passes beta**(t-1)
            torch_npu.npu_apply_adam_w(beta1 ** (step - 1), beta2 ** (step - 1), lr, weight_decay, beta1, beta2, eps,
                                       g, None, False, False, out=(p, m, v))
            copy = param_copies[i] if param_copies is not None else None
            if copy is not None:
                copy.copy_(p)
    if rest:
        dk.fused_adamw([params[i] for i in rest], [grads[i] for i in rest], [exp_avgs[i] for i in rest],
                       [exp_avg_sqs[i] for i in rest], step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
                       max_exp_avg_sqs=None if max_exp_avg_sqs is None else [max_exp_avg_sqs[i] for i in rest],
                       param_copies=None if param_copies is None else [param_copies[i] for i in rest])


def attention_kernels() -> FusedKernels:
    # torch_npu (as emulated here) has no scaled-masked-softmax or weight-gradient-accumulation op: devshim's run
    # on the NPU as ordinary torch ops
    return FusedKernels(
        attention=attention, rms_norm=rms_norm, swiglu=swiglu, rotary=rotary, masked_softmax=dk.masked_softmax,
        wgrad_accumulate=dk.wgrad_accumulate, grouped_gemm=grouped_gemm, attention_lse=attention_lse,
        source="torch_npu: npu_fusion_attention (its softmax statistics for attention_lse), npu_rms_norm, "
               "npu_swiglu, npu_rotary_mul, npu_grouped_matmul; "
               "devshim_kernels for "
               "masked_softmax, wgrad_accumulate, additive masks, masked TND and dtypes/shapes the vendor ops do "
               "not take")


def optimizer_kernels() -> OptimizerKernels:
    return host_defaults.optimizer_kernels(
        fused_adamw,
        "fused_adamw: torch_npu.npu_apply_adam_w (devshim_kernels.fused_adamw for Adam/L2, no bias "
        "correction, amsgrad, mixed dtypes)")
