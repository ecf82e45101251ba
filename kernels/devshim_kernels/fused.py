"""rms_norm, swiglu and rotary embedding with the conventions Megatron and the vendors use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight``, accumulated in fp32, returned in ``x.dtype``."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight


def swiglu(x: Tensor) -> Tensor:
    """``silu(a) * b`` for ``a, b = x.chunk(2, -1)`` (``a`` is the first half)."""
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleaved(x: Tensor) -> Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """``x * cos + rotate(x) * sin``; ``cos``/``sin`` broadcast against ``x`` (e.g. ``[S,1,1,D]`` for SBND,
    ``[1,1,S,D]`` for BNSD). Half mode rotates ``cat(-x2, x1)``; interleaved rotates adjacent pairs.
    Only the first ``cos.shape[-1]`` channels are rotated (partial rotary); the rest pass through."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rotate = _rotate_interleaved if interleaved else _rotate_half
    out = x_rot * cos + rotate(x_rot) * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)
