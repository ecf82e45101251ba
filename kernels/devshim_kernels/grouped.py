"""Grouped GEMM: one matmul per group of consecutive rows, as MoE experts run their tokens.

The reference every plugin's ``grouped_gemm`` is compared with, and what a plugin without one gets: a loop of
ordinary matmuls, differentiated by autograd, on whatever device the tensors are on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def group_sizes_list(group_sizes: Tensor | Sequence[int], groups: int, rows: int) -> list[int]:
    """``group_sizes`` as host ints, checked against ``groups`` weights and ``rows`` rows of ``x``."""
    if isinstance(group_sizes, Tensor):
        if group_sizes.dim() != 1 or group_sizes.is_floating_point() or group_sizes.is_complex():
            raise ValueError(f"group_sizes must be a 1-D integer tensor or a sequence of ints, got a "
                             f"{group_sizes.dim()}-D {group_sizes.dtype} tensor")
        sizes = [int(s) for s in group_sizes.tolist()]  # a host sync where the sizes live on the device
    else:
        sizes = [int(s) for s in group_sizes]
    if len(sizes) != groups:
        raise ValueError(f"group_sizes has {len(sizes)} entries but weight holds {groups} groups")
    if any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"group_sizes {sizes} must be non-negative and sum to x's {rows} rows")
    return sizes


def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor | Sequence[int], *, trans_b: bool = False) -> Tensor:
    """Rows ``x[start_g:start_g + group_sizes[g]]`` times ``weight[g]`` (``weight[g]^T`` with ``trans_b``), the
    groups' results stacked in order: ``x`` [T, K], ``weight`` [G, K, N] ([G, N, K] with ``trans_b``),
    ``group_sizes`` G non-negative ints summing to T (a 1-D integer tensor on any device, or a sequence) ->
    [T, N] in ``x``'s dtype. ``x`` and ``weight`` share a floating dtype. Differentiable in ``x`` and ``weight``
    (a group with no rows gets a zero weight gradient)."""
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(f"grouped_gemm takes x [T, K] and weight [G, K, N] (or [G, N, K] with trans_b), got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    if not x.is_floating_point() or x.dtype != weight.dtype:
        raise TypeError(f"grouped_gemm: x and weight must share a floating dtype, got {x.dtype} and {weight.dtype}")
    w = weight.transpose(1, 2) if trans_b else weight  # [G, K, N]
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"grouped_gemm: x has {x.shape[1]} columns but weight{' (transposed)' if trans_b else ''} "
                         f"{tuple(weight.shape)} multiplies {w.shape[1]}")
    sizes = group_sizes_list(group_sizes, w.shape[0], x.shape[0])
    if not sizes:
        return x.new_empty((0, w.shape[2]))
    return torch.cat([torch.matmul(rows, w[g]) for g, rows in enumerate(torch.split(x, sizes))])
