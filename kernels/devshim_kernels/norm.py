"""RMSNorm whose forward and hand-written backward each allocate a single full-size tensor.

Contiguous fp32 on the host, single-threaded, runs the native one-pass kernels of ``_native/rowwise.c``. Elsewhere:
on CPU the cost of the plain expression is dominated by its temporaries: every full-size tensor above
glibc's mmap threshold (32 MiB at most) is a fresh mapping whose pages fault in on first touch, which costs
more than the arithmetic. Here the work runs over row blocks small enough that the fp32 temporaries stay in
cache and are recycled by malloc; the only large allocations are the output and the input gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from devshim_kernels._native import rowwise

if TYPE_CHECKING:
    import ctypes

Tensor = torch.Tensor
_BLOCK_ELEMENTS = 1 << 18  # ~1 MiB of fp32 per temporary: fits L2, below the mmap threshold
# Below this many elements the plain expression wins: its few aten calls cost less than a Python
# autograd.Function's overhead, and its temporaries are small enough for malloc to recycle (bench/fused_ops.py)
MIN_CUSTOM_NUMEL = 1 << 18


def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dimension (``weight=None``: no scaling).

    The statistic is accumulated in fp32 (fp64 for fp64 input). As in Megatron's and Hugging Face's
    reference, the normalised value is rounded to ``x.dtype`` before the weight multiplies it, so the result
    has ``x``'s dtype promoted with ``weight``'s. Differentiable in ``x`` and ``weight``."""
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match the last dimension of {tuple(x.shape)}")
    if rowwise.serves(x, weight):
        return _NativeRMSNorm.apply(x, weight, eps)
    if x.numel() < MIN_CUSTOM_NUMEL:
        return _plain_rms_norm(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def _plain_rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    xf = x.to(_compute_dtype(x.dtype, x.dtype if weight is None else weight.dtype))
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else normed * weight


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _block_rows(width: int) -> int:
    return max(1, _BLOCK_ELEMENTS // max(1, width))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        width = x.shape[-1]
        rows2d = x.reshape(-1, width)
        out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
        cdt = _compute_dtype(x.dtype, out_dtype)
        out = torch.empty(rows2d.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows2d.shape[0], 1, dtype=cdt, device=x.device)
        step = _block_rows(width)
        for start in range(0, rows2d.shape[0], step):
            xb, ob, rb = rows2d[start:start + step], out[start:start + step], rstd[start:start + step]
            xf = xb.to(cdt)
            torch.linalg.vector_norm(xf, dim=-1, keepdim=True, out=rb)
            rb.square_().div_(width).add_(eps).rsqrt_()
            if xf is xb:  # already in the compute dtype: one pass straight into the output
                torch.mul(xf, rb, out=ob)
            else:  # xf is our block-sized copy; round the normalised value to x.dtype as the reference does
                xf.mul_(rb)
                ob.copy_(xf if out_dtype == x.dtype else xf.to(x.dtype))
            if weight is not None:
                ob.mul_(weight)
        ctx.save_for_backward(rows2d, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        # y = w * x * r with r = (mean(x^2) + eps)^-1/2, g = dy * w:
        #   dx = r * (g - x * r^2 * mean(g * x)),   dw = sum over rows of dy * x * r
        rows2d, weight, rstd = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and weight is not None
        width, cdt = rows2d.shape[-1], rstd.dtype
        dy2d = grad.reshape(-1, width)
        dx = torch.empty(rows2d.shape, dtype=rows2d.dtype, device=rows2d.device) if want_x else None
        wf = weight.to(cdt) if weight is not None else None
        dw = torch.zeros(1, width, dtype=cdt, device=rows2d.device) if want_w else None
        step = _block_rows(width)
        # fp32/fp64 input: work in the gradient's own rows; otherwise in one block-sized fp32 scratch
        scratch = None if rows2d.dtype == cdt and want_x else \
            torch.empty(min(rows2d.shape[0], step), width, dtype=cdt, device=rows2d.device)
        for start in range(0, rows2d.shape[0], step):
            xf, dyf = rows2d[start:start + step].to(cdt), dy2d[start:start + step].to(cdt)
            rb = rstd[start:start + step]
            # no scratch only where want_x, so dx is a tensor
            buf = cast(Tensor, dx)[start:start + step] if scratch is None else scratch[:xf.shape[0]]
            torch.mul(dyf, xf, out=buf)
            if dw is not None:
                dw.addmm_(rb.view(1, -1), buf)
            if not want_x:
                continue
            mean_gx = (buf @ wf if wf is not None else buf.sum(-1)).unsqueeze(-1).div_(width)
            coeff = mean_gx.mul_(rb).mul_(rb)
            if wf is not None:
                torch.mul(dyf, wf, out=buf)
                buf.addcmul_(xf, coeff, value=-1)
            else:
                torch.addcmul(dyf, xf, coeff, value=-1, out=buf)
            buf.mul_(rb)
            if scratch is not None:
                cast(Tensor, dx)[start:start + step].copy_(buf)  # want_x: a tensor
        grad_x = dx.view(grad.shape) if dx is not None else None
        grad_w = dw.view(width).to(weight.dtype) if dw is not None else None
        return grad_x, grad_w, None


class _NativeRMSNorm(torch.autograd.Function):
    """The same formula on ``_native/rowwise.c``: one pass per row forward, one backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        out = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32)
        library = cast("ctypes.CDLL", rowwise.LIBRARY)  # not None: run only where rowwise.serves()
        library.devshim_rms_norm_forward(x.data_ptr(), rowwise.address(weight), out.data_ptr(),
                                         rstd.data_ptr(), rows, width, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and weight is not None
        grad = grad.contiguous()
        dx = torch.empty_like(x) if want_x else None
        dw = torch.zeros(x.shape[-1], dtype=torch.float32) if want_w else None
        library = cast("ctypes.CDLL", rowwise.LIBRARY)  # not None: run only where rowwise.serves()
        library.devshim_rms_norm_backward(x.data_ptr(), rowwise.address(weight), rstd.data_ptr(),
                                          grad.data_ptr(), rowwise.address(dx), rowwise.address(dw),
                                          rstd.numel(), x.shape[-1])
        return dx, dw, None
