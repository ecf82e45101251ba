"""The ``grouped_gemm`` package Megatron's legacy ``GroupedMLP`` imports for ``moe_grouped_gemm``, on the device's
``grouped_gemm`` kernel.

``megatron.core.transformer.moe.grouped_gemm_util`` imports ``grouped_gemm`` once, at import time, and asserts it
is there when a ``GroupedMLP`` is built (the local spec's experts under ``moe_grouped_gemm``, TransformerEngine
being absent); ``GroupedMLP.forward`` then calls ``grouped_gemm.ops.gmm(tokens [T, K], weight [E, K, N],
tokens_per_expert, trans_b=False)``, differentiable in tokens and weights. The real package (CUTLASS, CUDA-only) also
has ``grouped_gemm.backend.gmm(a, b, batch_sizes, trans_a=False, trans_b=False, c=None)``, kept here with the same
meaning for code that calls it directly.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from devshim_core.device import Device

Tensor = torch.Tensor
MODULE_NAME = "grouped_gemm"


def _kernel(device: Device) -> Callable[..., Tensor]:
    kernel = device.attention.grouped_gemm
    if kernel is not None:
        return kernel

    def missing(*args: object, **kwargs: object) -> Tensor:
        raise RuntimeError(
            f"moe_grouped_gemm=True runs the experts' grouped GEMM on the device's grouped_gemm kernel, and devshim's "
            f"{device.plugin} plugin provides none (its FusedKernels.grouped_gemm is None and devshim-kernels, "
            "whose loop of matmuls stands in for it, is not installed): pip install devshim-kernels, or set "
            "moe_grouped_gemm=False (drop --moe-grouped-gemm) to run SequentialMLP")

    return missing


def make_module(device: Device) -> types.ModuleType:
    """A package named ``grouped_gemm`` with ``ops.gmm`` and ``backend.gmm`` on ``device.attention.grouped_gemm``
    (or, if the plugin has none, raising a RuntimeError naming ``moe_grouped_gemm``)."""
    kernel = _kernel(device)
    package = types.ModuleType(MODULE_NAME, f"grouped_gemm (Megatron's grouped GEMM for MoE experts) on devshim's "
                                            f"{device.plugin} device (device.attention.grouped_gemm).")
    package.__path__ = []  # a package, so that `import grouped_gemm.ops` resolves through sys.modules
    ops = types.ModuleType(f"{MODULE_NAME}.ops", "grouped_gemm.ops.gmm on the device's grouped_gemm kernel.")
    backend = types.ModuleType(f"{MODULE_NAME}.backend",
                               "grouped_gemm.backend.gmm on the device's grouped_gemm kernel.")

    def gmm(a: Tensor, b: Tensor, batch_sizes: Tensor | Sequence[int], trans_b: bool = False) -> Tensor:
        """Rows of ``a`` [T, K] grouped by ``batch_sizes`` times ``b[g]`` ([E, K, N], or [E, N, K] transposed with
        ``trans_b``) -> [T, N]; differentiable in ``a`` and ``b``. ``batch_sizes`` may be on the host or the
        device (the real package wants an int64 host tensor)."""
        return kernel(a, b, batch_sizes, trans_b=trans_b)

    def backend_gmm(a: Tensor, b: Tensor, batch_sizes: Tensor | Sequence[int], trans_a: bool = False,
                    trans_b: bool = False, c: Tensor | None = None) -> Tensor:
        """``trans_a``: ``a`` [T, K] and ``b`` [T, N] grouped by rows -> [E, K, N], ``a_g^T @ b_g`` (the weight
        gradient); otherwise :func:`gmm`. Written into ``c`` when given, as the real backend does."""
        if trans_a and trans_b:
            raise ValueError("grouped_gemm.backend.gmm: trans_a and trans_b cannot both be set")
        if trans_a:
            # the weight-gradient product: a loop of matmuls (the device op's contract has no transposed x)
            counts = [int(n) for n in (batch_sizes.tolist() if isinstance(batch_sizes, Tensor) else batch_sizes)]
            result = torch.stack([a_g.t() @ b_g for a_g, b_g in zip(a.split(counts), b.split(counts), strict=True)])
        else:
            result = kernel(a, b, batch_sizes, trans_b=trans_b)
        if c is None:
            return result
        with torch.no_grad():
            c.copy_(result)
        return c

    gmm.__module__ = ops.__name__
    backend_gmm.__module__ = backend.__name__
    backend_gmm.__name__ = backend_gmm.__qualname__ = "gmm"
    ops.gmm = gmm  # type: ignore[attr-defined]  # a ModuleType built here
    backend.gmm = backend_gmm  # type: ignore[attr-defined]  # a ModuleType built here
    package.ops = ops  # type: ignore[attr-defined]  # a ModuleType built here
    package.backend = backend  # type: ignore[attr-defined]  # a ModuleType built here
    package.devshim_plugin = device.plugin  # type: ignore[attr-defined]  # for reports: whose kernel this is
    return package


def make_modules(device: Device) -> dict[str, types.ModuleType]:
    """``grouped_gemm`` and its two submodules, by their import names, for ``sys.modules``."""
    package = make_module(device)
    return {MODULE_NAME: package, f"{MODULE_NAME}.ops": package.ops, f"{MODULE_NAME}.backend": package.backend}


def is_standin(module: object) -> bool:
    """Whether ``module`` is a ``grouped_gemm`` built here (not the real, CUDA-only package)."""
    return isinstance(module, types.ModuleType) and hasattr(module, "devshim_plugin") and (
        module.__name__ == MODULE_NAME)
