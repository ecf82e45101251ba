"""Rotary position embedding, half and interleaved, with the backward as the transposed rotation.

The rotation ``R`` (``rotate_half`` or the interleaved pair swap) is skew-symmetric, so the gradient of
``x*cos + R(x)*sin`` is ``dy*cos - R(dy*sin)``: the same three fused passes as the forward, on the output
buffer, instead of autograd's negations, ``cat`` and sliced-gradient accumulation.
"""

from __future__ import annotations

from typing import Any

import torch

from devshim_kernels.shapes import broadcasts_to

Tensor = torch.Tensor
# Below this the plain expression's few aten calls beat the Function's overhead: measured from about 16k elements
# with a backward to run, from about 32k forward alone (bench/fused_ops.py times a 128k-element TP shard).
MIN_CUSTOM_NUMEL = 1 << 15


def rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """``x * cos + rotate(x) * sin`` over the first ``cos.shape[-1]`` channels; the rest pass through
    (partial rotary).

    - half mode (Megatron's default, ``npu_rotary_mul(..., rotary_mode='half')``): ``rotate(x) = cat(-x2, x1)``
      for the two halves x1, x2; interleaved (GPT-J style): each adjacent pair (x0, x1) becomes (-x1, x0).
    - ``cos``/``sin`` broadcast against ``x`` without enlarging it: [S, 1, 1, D] for SBND, [1, S, 1, D] for
      BSND, [1, 1, S, D] or [S, D] for BNSD, or the full shape.
    - Computed in ``x``'s dtype (``cos``/``sin`` are cast to it, as Megatron does) and returned in it.
    - Differentiable in ``x``; if ``cos``/``sin`` require grad (or ``x`` is small), autograd differentiates the
      plain expression instead.
    """
    rot = cos.shape[-1]
    if sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"cannot rotate {rot} of the {x.shape[-1]} channels: need an even count that fits")
    if not broadcasts_to(cos.shape[:-1], x.shape[:-1]):
        raise ValueError(f"cos/sin of shape {tuple(cos.shape)} do not broadcast to x of shape {tuple(x.shape)}")
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if x.numel() < MIN_CUSTOM_NUMEL or ((cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled()):
        return _plain_rotary(x, cos, sin, interleaved)
    return _Rotary.apply(x, cos, sin, interleaved)


def _plain_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    rot = cos.shape[-1]
    x_rot = x[..., :rot]
    if interleaved:
        turned = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    rotated = x_rot * cos + turned * sin
    return rotated if rot == x.shape[-1] else torch.cat((rotated, x[..., rot:]), dim=-1)


def _rotate_into(out: Tensor, src: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, sign: int) -> None:
    """``out[..., :rot] = src*cos + sign * R(src)*sin`` (``sign=-1``: the transposed rotation);
    channels past ``rot`` are copied."""
    rot = cos.shape[-1]
    out_rot, src_rot = out[..., :rot], src[..., :rot]
    torch.mul(src_rot, cos, out=out_rot)
    if interleaved:
        out_a, out_b, src_a, src_b = out_rot[..., 0::2], out_rot[..., 1::2], src_rot[..., 0::2], src_rot[..., 1::2]
        sin_a, sin_b = sin[..., 0::2], sin[..., 1::2]
    else:
        (out_a, out_b), (src_a, src_b) = out_rot.chunk(2, dim=-1), src_rot.chunk(2, dim=-1)
        sin_a, sin_b = sin.chunk(2, dim=-1)
    if sign > 0:  # R(s) = (-s_b, s_a)
        out_a.addcmul_(src_b, sin_a, value=-1)
        out_b.addcmul_(src_a, sin_b)
    else:  # R^T(s) = (s_b, -s_a), each half meeting the sin of the slot it came from
        out_a.addcmul_(src_b, sin_b)
        out_b.addcmul_(src_a, sin_a, value=-1)
    if rot < out.shape[-1]:
        out[..., rot:].copy_(src[..., rot:])


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        out = torch.empty_like(x)
        _rotate_into(out, x, cos, sin, interleaved, +1)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        dx = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        _rotate_into(dx, grad, cos, sin, ctx.interleaved, -1)
        return dx, None, None, None
