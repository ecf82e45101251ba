"""Weight-gradient accumulation into a separate main-gradient buffer, as Megatron's gradient-accumulation fusion
(``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16``) does: ``main_grad += dY^T @ X`` in one GEMM,
without materialising the weight gradient in the parameter's dtype first.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
_BLOCK_ELEMENTS = 1 << 18  # rows of low-precision operands converted to fp32 per step: ~1 MiB temporaries


def wgrad_accumulate(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` in place, the leading dimensions of both flattened into one
    token dimension: ``total_input`` [..., in], ``grad_output`` [..., out], ``main_grad`` [out, in].

    Products are summed in fp32 (fp64 if any operand is fp64) whatever the operands' dtypes, and the sum is added
    to ``main_grad`` with a single rounding to its dtype (fp32 for ``wgrad_gemm_accum_fp32``, fp16/bf16 for
    ``wgrad_gemm_accum_fp16``). Not differentiable: it runs inside a backward pass."""
    x = total_input.reshape(-1, total_input.shape[-1])
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"total_input {tuple(total_input.shape)} and grad_output {tuple(grad_output.shape)} "
                         "hold different numbers of tokens")
    if tuple(main_grad.shape) != (dy.shape[1], x.shape[1]):
        raise ValueError(f"main_grad of shape {tuple(main_grad.shape)} is not [out, in] = "
                         f"[{dy.shape[1]}, {x.shape[1]}]")
    acc = torch.float64 if torch.float64 in (x.dtype, dy.dtype, main_grad.dtype) else torch.float32
    with torch.no_grad():
        if x.dtype == dy.dtype == main_grad.dtype == acc:
            main_grad.addmm_(dy.t(), x)
            return
        # low-precision operands: convert row blocks so the temporaries stay small, sum the products in `acc`
        target = main_grad if main_grad.dtype == acc else torch.zeros(main_grad.shape, dtype=acc,
                                                                      device=main_grad.device)
        step = max(1, _BLOCK_ELEMENTS // max(1, x.shape[1] + dy.shape[1]))
        for start in range(0, x.shape[0], step):
            target.addmm_(dy[start:start + step].t().to(acc), x[start:start + step].to(acc))
        if target is not main_grad:
            main_grad.add_(target)  # computed in `acc`, rounded once to main_grad's dtype
