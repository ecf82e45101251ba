"""rms_norm, swiglu and rotary (half, interleaved): devshim's kernels against the math written out in torch.

The peer is the expression a model would write (Megatron's and Hugging Face's unfused fallbacks), with
autograd for the backward. Both sides run forward+backward (``torch.autograd.grad``, so no gradient
accumulation pass) on the same tensors, interleaved; forward alone is reported too. Target: devshim no slower
(time ratio <= 1.0). Sizes: LLaMA-7B-like activations, 4096 tokens x hidden 4096 (swiglu: 2 x 4096 in; rotary:
32 heads of 128), and 8192 tokens x hidden 2048 (rms_norm there without weight).
"""

from __future__ import annotations

from collections.abc import Callable

import devshim_kernels as K
import torch
import torch.nn.functional as F

from bench.common import Comparison, Result, time_min_interleaved

Tensor = torch.Tensor
EPS = 1e-6
TARGET = "≥ 1.0× the speed of the plain torch expression"


def plain_rms_norm(x: Tensor, w: Tensor | None = None) -> Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return normed if w is None else normed * w


def plain_swiglu(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def plain_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    return x * cos + turned * sin


def _cases(quick: bool) -> list[tuple[str, Callable[[torch.dtype], tuple]]]:
    """(name, make(dtype) -> (inputs, devshim fn, plain fn)) for LLaMA-7B-like and smaller-hidden shapes."""
    (tokens, hidden), (long_tokens, narrow) = ((64, 256), (128, 128)) if quick else ((4096, 4096), (8192, 2048))
    heads, head_dim = hidden // 128 or 1, min(hidden, 128)

    def norm(rows: int, width: int, weighted: bool) -> Callable[[torch.dtype], tuple]:
        def make(dtype: torch.dtype) -> tuple:
            x = torch.randn(rows, width, dtype=dtype)
            if not weighted:
                return (x,), lambda x: K.rms_norm(x, None, EPS), plain_rms_norm
            return (x, torch.randn(width, dtype=dtype)), lambda x, w: K.rms_norm(x, w, EPS), plain_rms_norm
        return make

    def glu(rows: int, width: int) -> Callable[[torch.dtype], tuple]:
        return lambda dtype: ((torch.randn(rows, 2 * width, dtype=dtype),), K.swiglu, plain_swiglu)

    def rope(interleaved: bool) -> Callable[[torch.dtype], tuple]:
        def make(dtype: torch.dtype) -> tuple:
            x = torch.randn(tokens, 1, heads, head_dim, dtype=dtype)  # SBND, as Megatron applies it
            angles = torch.randn(tokens, 1, 1, head_dim // 2)
            angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            return ((x,), lambda x: K.rotary(x, cos, sin, interleaved=interleaved),
                    lambda x: plain_rotary(x, cos, sin, interleaved))
        return make

    rope_size = f"{tokens}x1x{heads}x{head_dim}"
    return [(f"rms_norm {tokens}x{hidden}", norm(tokens, hidden, True)),
            (f"rms_norm no-weight {long_tokens}x{narrow}", norm(long_tokens, narrow, False)),
            (f"swiglu {tokens}x2*{hidden}", glu(tokens, hidden)),
            (f"swiglu {long_tokens}x2*{narrow}", glu(long_tokens, narrow)),
            (f"rotary half {rope_size}", rope(False)), (f"rotary interleaved {rope_size}", rope(True))]


def _forward(fn: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> Callable[[], object]:
    return lambda: fn(*inputs)


def _fwd_bwd(fn: Callable[..., Tensor], inputs: tuple[Tensor, ...], grad: Tensor) -> Callable[[], object]:
    return lambda: torch.autograd.grad(fn(*inputs), inputs, grad)


def run(quick: bool = False) -> list[Result]:
    torch.manual_seed(0)
    repeats, warmup = (2, 1) if quick else (7, 2)
    results: list[Result] = []
    for name, make in _cases(quick):
        for dtype in (torch.float32, torch.bfloat16):
            inputs, ours, plain = make(dtype)
            leaves = tuple(t.requires_grad_() for t in inputs)
            grad = torch.randn_like(plain(*leaves))
            with torch.no_grad():
                fwd = time_min_interleaved({"devshim": _forward(ours, leaves), "plain": _forward(plain, leaves)},
                                           repeats=repeats, warmup=warmup)
            both = time_min_interleaved({"devshim": _fwd_bwd(ours, leaves, grad),
                                         "plain": _fwd_bwd(plain, leaves, grad)}, repeats=repeats, warmup=warmup)
            dt = str(dtype).removeprefix("torch.")
            for mode, times in (("fwd+bwd", both), ("fwd", fwd)):
                results.append(Comparison("fused_ops", f"{name} {dt} {mode}", "devshim_kernels", times["devshim"],
                                          "plain torch + autograd", times["plain"], 1.0, TARGET))
    return results
