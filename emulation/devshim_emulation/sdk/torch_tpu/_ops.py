"""Sophgo's fused kernels (simulated): ``torch.ops.my_ops`` out-parameter operators.

Schemas from sophgo/torch-tpu (``torch_tpu/csrc/ops/my_ops/{myOps,RMSNorm,LLamaMlp,PagedAttention}.cpp``):
the caller allocates the outputs and the op writes them and returns the main one. Like the vendor's, they run
only on TPU tensors (``CHECK_TENSOR_IN_DEVICE``), are not differentiable themselves (Sophgo wraps them in
autograd Functions with the matching ``*_backward`` op) and compute here with plain torch (written-out formulas,
torch's own ``scaled_dot_product_attention``), never ``devshim_kernels``, so that the conformance kit compares two
independent implementations. Sophgo has no standalone swiglu or rotary op; rotary is fused into
``llama_attention_forward``. Not Sophgo's code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
DEVICE = "tpu"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

_LIB = torch.library.Library("my_ops", "FRAGMENT")  # kept referenced: dropping it unregisters the ops


def _on_tpu(op: str, **tensors: Tensor | None) -> None:
    """The vendor's CHECK_TENSOR_IN_DEVICE: host tensors are refused."""
    for name, t in tensors.items():
        if t is not None and t.device.type != DEVICE:
            raise RuntimeError(f"my_ops.{op}: {name} is on {t.device}, but the kernel runs on TPU tensors only; "
                               "move it with .to('tpu')")


def _check_out(op: str, name: str, out: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"my_ops.{op}: {name} must be a preallocated {dtype} tensor of shape {tuple(shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")


def _inner(op: str, x: Tensor, axis: int) -> int:
    """Elements normalised per row: the dimensions from ``axis`` on. The kernel sizes its outer/inner loops from a
    non-negative axis (``c10::irange(axis)``), so a negative one is refused rather than misread."""
    if not 0 <= axis < x.dim():
        raise ValueError(f"my_ops.{op}: axis must be in [0, {x.dim() - 1}] (the first normalised dimension; the "
                         f"last one is input.dim() - 1), got {axis}")
    return math.prod(x.shape[axis:])


def _param(op: str, name: str, t: Tensor | None, inner: int) -> Tensor | None:
    if t is None:
        return None
    if t.numel() != inner:
        raise ValueError(f"my_ops.{op}: {name} has {t.numel()} elements but the normalised dimensions hold {inner}")
    return t.reshape(inner)


def _rms_norm(rows: Tensor, scale: Tensor | None, eps: float) -> Tensor:
    """``rows / sqrt(mean(rows**2) + eps) * scale`` over the last dimension, in fp32 (differentiable)."""
    xf = rows.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y if scale is None else y * scale.float()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), dim=-1)


# -- rmsnorm_forward / rmsnorm_backward ----------------------------------------------------------------------------

_LIB.define("rmsnorm_forward(Tensor input, Tensor? scale, Tensor? bias, Tensor(a!) output, int axis, float eps) "
            "-> Tensor(a!)")


@torch.no_grad()
def _rmsnorm_forward(x: Tensor, scale: Tensor | None, bias: Tensor | None, output: Tensor, axis: int,
                     eps: float) -> Tensor:
    """``output = x / sqrt(mean(x**2 over dims[axis:]) + eps) * scale + bias`` (``scale``/``bias`` optional, each
    the size of the normalised dimensions); written into ``output`` (``x``'s shape and dtype) and returned."""
    op = "rmsnorm_forward"
    _on_tpu(op, input=x, scale=scale, bias=bias, output=output)
    if x.dtype not in _FLOATS:
        raise TypeError(f"my_ops.{op}: input must be float32, float16 or bfloat16, got {x.dtype}")
    _check_out(op, "output", output, tuple(x.shape), x.dtype)
    inner = _inner(op, x, axis)
    y = _rms_norm(x.reshape(-1, inner), _param(op, "scale", scale, inner), eps)
    b = _param(op, "bias", bias, inner)
    if b is not None:
        y = y + b.float()
    output.copy_(y.view(x.shape))
    return output


_LIB.define("rmsnorm_backward(Tensor grad_output, Tensor input, Tensor? scale, Tensor? bias, Tensor(a!) rms, "
            "Tensor(b!)? grad_input, Tensor(c!)? grad_scale, Tensor(d!)? grad_bias, int axis, float eps) -> Tensor(a!)")


def _rmsnorm_backward(grad_output: Tensor, x: Tensor, scale: Tensor | None, bias: Tensor | None, rms: Tensor,
                      grad_input: Tensor | None, grad_scale: Tensor | None, grad_bias: Tensor | None, axis: int,
                      eps: float) -> Tensor:
    """Gradients of :func:`rmsnorm_forward`, written into whichever of ``grad_input``/``grad_scale``/``grad_bias``
    are given. ``rms`` is the vendor's scratch buffer (Sophgo's wrapper passes ``zeros_like(grad_output)`` and
    discards it); the emulation leaves it as it is and returns it, as the vendor op does."""
    op = "rmsnorm_backward"
    _on_tpu(op, grad_output=grad_output, input=x, scale=scale, bias=bias, rms=rms, grad_input=grad_input,
            grad_scale=grad_scale, grad_bias=grad_bias)
    inner = _inner(op, x, axis)
    w = _param(op, "scale", scale, inner)
    _param(op, "bias", bias, inner)
    want = [t for t in (grad_input, grad_scale if w is not None else None) if t is not None]
    with torch.enable_grad():
        xr = x.detach().reshape(-1, inner).requires_grad_(grad_input is not None)
        wr = w.detach().requires_grad_(grad_scale is not None) if w is not None else None
        y = _rms_norm(xr, wr, eps)
        leaves = [t for t in (xr, wr) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(y, leaves, grad_output.reshape(y.shape).to(y.dtype)) if leaves else ()
    with torch.no_grad():
        for target, g in zip(want, grads, strict=True):
            target.copy_(g.view(target.shape))
        if grad_scale is not None and w is None:
            grad_scale.zero_()
        if grad_bias is not None:
            grad_bias.copy_(grad_output.reshape(-1, inner).float().sum(0).view(grad_bias.shape))
    return rms


_LIB.impl("rmsnorm_forward", _rmsnorm_forward, "CompositeExplicitAutograd")
_LIB.impl("rmsnorm_backward", _rmsnorm_backward, "CompositeExplicitAutograd")


# -- llama_mlp_forward ---------------------------------------------------------------------------------------------

_LIB.define("llama_mlp_forward(Tensor input, Tensor weight0, Tensor weight1, Tensor weight2, Tensor? bias0, "
            "Tensor? bias1, Tensor? bias2, Tensor(a!)? fc1, Tensor(b!)? m0, Tensor(c!) output, bool save_mid_res) "
            "-> Tensor(c!)")


@torch.no_grad()
def _llama_mlp_forward(x: Tensor, weight0: Tensor, weight1: Tensor, weight2: Tensor, bias0: Tensor | None,
                       bias1: Tensor | None, bias2: Tensor | None, fc1: Tensor | None, m0: Tensor | None,
                       output: Tensor, save_mid_res: bool) -> Tensor:
    """LLaMA's gated MLP on ``x`` [tokens, h]: ``output = (x @ weight0.T * silu(x @ weight1.T)) @ weight2``.

    ``weight0`` is the up projection [i, h], ``weight1`` the gate projection [i, h] (the one through SiLU),
    ``weight2`` the down projection transposed, [i, h] (Sophgo passes ``down_proj.weight.t().contiguous()``);
    biases add after their matmul. With ``save_mid_res`` the op also writes ``fc1 = x @ weight1.T`` (before SiLU)
    and ``m0 = x @ weight0.T``, which Sophgo's backward reads (``mlp_backward``). SG2260 only (BM1684X refuses it).
    """
    op = "llama_mlp_forward"
    _on_tpu(op, input=x, weight0=weight0, weight1=weight1, weight2=weight2, bias0=bias0, bias1=bias1, bias2=bias2,
            fc1=fc1, m0=m0, output=output)
    from torch_tpu import CHIP_ARCH

    if CHIP_ARCH == "bm1684x":
        raise RuntimeError("BM1684X backend not support llama_mlp_forward")
    if x.dim() != 2 or weight0.dim() != 2 or weight0.shape != weight1.shape or weight2.shape != weight0.shape \
            or weight0.shape[1] != x.shape[1]:
        raise ValueError(f"my_ops.{op}: expected input [tokens, h] and weight0/weight1/weight2 [i, h], got "
                         f"{tuple(x.shape)}, {tuple(weight0.shape)}, {tuple(weight1.shape)}, {tuple(weight2.shape)}")
    _check_out(op, "output", output, tuple(x.shape), x.dtype)
    up = torch.nn.functional.linear(x, weight0, bias0)
    gate = torch.nn.functional.linear(x, weight1, bias1)
    hidden = (F.silu(gate.float()) * up.float()).to(x.dtype)
    out = hidden @ weight2
    if bias2 is not None:
        out = out + bias2
    output.copy_(out)
    if save_mid_res:
        for name, buf, value in (("fc1", fc1, gate), ("m0", m0, up)):
            if buf is None:
                raise ValueError(f"my_ops.{op}: save_mid_res=True needs the {name} buffer")
            _check_out(op, name, buf, tuple(value.shape), x.dtype)
            buf.copy_(value)
    return output


_LIB.impl("llama_mlp_forward", _llama_mlp_forward, "CompositeExplicitAutograd")


# -- llama_attention_forward ---------------------------------------------------------------------------------------

_LIB.define("llama_attention_forward(Tensor(a!) OUT, Tensor Q, Tensor K, Tensor V, Tensor? cos, Tensor? sin, "
            "Tensor? mask, Tensor(b!)? softmax_lse, Tensor input_lengths, int mask_size, float C, "
            "float dropout_rate, int batch) -> Tensor(a!)")


@torch.no_grad()
def _llama_attention_forward(out: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None,
                             mask: Tensor | None, softmax_lse: Tensor | None, input_lengths: Tensor, mask_size: int,
                             scale: float, dropout_rate: float, batch: int) -> Tensor:
    """Packed prefill attention with rotary embedding fused in (Sophgo's training/prefill kernel).

    ``Q`` [tokens, Hq, D], ``K``/``V`` [tokens, Hkv, D] (grouped-query allowed), ``batch`` sequences of
    ``input_lengths`` tokens each (a host int32 tensor, read on the host). ``cos``/``sin`` [S, 1, D] rotate q and k
    (rotate-half) at positions 0..len-1 of every sequence. ``mask`` [tokens, mask_size] is additive, one row per
    query token over its sequence's keys (Sophgo's tests pass ``triu(-10000, 1)``); a bool mask is read as
    Megatron's (True = masked out), which is how Sophgo's Megatron adaptor passes it — unconfirmed against the
    kernel. ``C`` is the softmax scale. Writes ``OUT`` [tokens, Hq, D] and, if given, ``softmax_lse``
    [tokens, Hq, 1] (fp32 log-sum-exp of the scaled, masked scores).
    """
    op = "llama_attention_forward"
    _on_tpu(op, OUT=out, Q=q, K=k, V=v, cos=cos, sin=sin, mask=mask, softmax_lse=softmax_lse)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"my_ops.{op}: Q/K/V must be [tokens, heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    _check_out(op, "OUT", out, (q.shape[0], q.shape[1], v.shape[-1]), q.dtype)
    lengths = [int(n) for n in input_lengths.reshape(-1).tolist()][:batch]
    if len(lengths) != batch or sum(lengths) > q.shape[0]:
        raise ValueError(f"my_ops.{op}: input_lengths {lengths} do not describe {batch} sequences within "
                         f"{q.shape[0]} tokens")
    if (cos is None) != (sin is None):
        raise ValueError(f"my_ops.{op}: pass both cos and sin, or neither")
    if mask is not None and (mask.dim() != 2 or mask.shape[-1] < max(lengths, default=0)):
        raise ValueError(f"my_ops.{op}: mask must be [tokens, mask_size={mask_size}], got {tuple(mask.shape)}")
    start = 0
    for n in lengths:
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        if cos is not None:  # rotate-half at positions 0..n-1, in fp32
            c, s = cos[:n].reshape(n, 1, -1).float(), sin[:n].reshape(n, 1, -1).float()
            qs, ks = ((t.float() * c + _rotate_half(t.float()) * s).to(t.dtype) for t in (qs, ks))
        bias = None
        if mask is not None:
            rows = mask[start:start + n, :n]
            bias = (torch.zeros(rows.shape, dtype=torch.float32, device=q.device).masked_fill_(rows, float("-inf"))
                    if rows.dtype == torch.bool else rows.float())
        if softmax_lse is not None:
            kr = ks.repeat_interleave(q.shape[1] // ks.shape[1], 1)
            scores = torch.einsum("qhd,khd->hqk", qs.float(), kr.float()) * scale
            if bias is not None:
                scores = scores + bias
            softmax_lse[start:start + n].copy_(torch.logsumexp(scores, -1).transpose(0, 1).unsqueeze(-1))
        # [n, H, D] -> [1, H, n, D]; key/value heads repeated up to the query's (grouped-query)
        repeat = q.shape[1] // ks.shape[1]
        attn = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.repeat_interleave(repeat, 1).transpose(0, 1)[None],
            vs.repeat_interleave(repeat, 1).transpose(0, 1)[None], attn_mask=None if bias is None else bias.to(q.dtype),
            dropout_p=dropout_rate, scale=scale)
        out[start:start + n].copy_(attn[0].transpose(0, 1))
        start += n
    return out


_LIB.impl("llama_attention_forward", _llama_attention_forward, "CompositeExplicitAutograd")

__all__ = ["DEVICE"]
