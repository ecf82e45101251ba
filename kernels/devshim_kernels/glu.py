"""SwiGLU with a backward that writes both halves of the gradient straight into one buffer.

Contiguous fp32 on the host, single-threaded, runs the native one-pass kernels of ``_native/rowwise.c``.
Elsewhere: autograd on ``silu(a) * b`` keeps ``silu(a)``, allocates each half's gradient and then ``cat``s them; here
the forward saves only ``x`` and the backward fills the two halves of ``dx`` in place with aten's fused
``silu``/``silu_backward`` kernels: two full-size allocations in all (output and gradient).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from devshim_kernels._native import rowwise

if TYPE_CHECKING:
    import ctypes

Tensor = torch.Tensor
_aten = torch.ops.aten
MIN_CUSTOM_NUMEL = 1 << 18  # below this the plain expression's few aten calls beat the Function's overhead


def swiglu(x: Tensor) -> Tensor:
    """``silu(a) * b`` for ``a, b = x.chunk(2, -1)`` (``a`` is the first half), as Megatron's ``swiglu`` and
    ``torch_npu.npu_swiglu``. Differentiable; any strides."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension, got {x.shape[-1]}")
    if rowwise.serves(x):
        return _NativeSwiGLU.apply(x)
    if x.numel() < MIN_CUSTOM_NUMEL:
        a, b = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b
    return _SwiGLU.apply(x)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        a, b = x.chunk(2, dim=-1)
        out = torch.empty(a.shape, dtype=x.dtype, device=x.device)
        _aten.silu.out(a, out=out)
        out.mul_(b)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        da, db = dx.chunk(2, dim=-1)
        _aten.silu.out(a, out=db)  # d/db = silu(a)
        db.mul_(grad)
        torch.mul(grad, b, out=da)  # d/da = grad * b * silu'(a)
        _aten.silu_backward.grad_input(da, a, grad_input=da)
        return dx


class _NativeSwiGLU(torch.autograd.Function):
    """The same on ``_native/rowwise.c``: one pass forward (saving only ``x``), one backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1] if half else 0
        out = torch.empty((*x.shape[:-1], half), dtype=x.dtype)
        library = cast("ctypes.CDLL", rowwise.LIBRARY)  # not None: run only where rowwise.serves()
        library.devshim_swiglu_forward(x.data_ptr(), out.data_ptr(), rows, half)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch.empty_like(x)
        half = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1] if half else 0
        library = cast("ctypes.CDLL", rowwise.LIBRARY)  # not None: run only where rowwise.serves()
        library.devshim_swiglu_backward(x.data_ptr(), grad.data_ptr(), dx.data_ptr(), rows, half)
        return dx
