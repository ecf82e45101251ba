"""CUDA-only modules Megatron imports at import time: provided through the plugin, or blocked cleanly.

Megatron wraps these imports in ``try/except ImportError`` and takes a torch fallback when they fail. A CUDA
build of apex or TransformerEngine installed on a machine without CUDA does not fail that way: it imports,
then crashes or computes on the wrong device later. Blocking them makes the fallback certain.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any

from devshim_core.device import Device
from devshim_core.errors import ConfigError

_NO_CUDA = "a CUDA extension; devshim blocks it off CUDA so that Megatron takes its torch fallback"
_NO_SOFTMAX = ("a CUDA extension that devshim provides on the plugin's masked_softmax kernel, and this plugin has "
               "none: turn masked-softmax fusion off (--no-masked-softmax-fusion) so that Megatron takes its torch "
               "softmax")

BLOCKED: dict[str, str] = {
    "amp_C": _NO_CUDA,
    "fused_layer_norm_cuda": _NO_CUDA,
    "fused_mix_prec_layer_norm_cuda": _NO_CUDA,
    # provided on the plugin's masked_softmax (softmax_modules); blocked only where the plugin has no such kernel
    "scaled_masked_softmax_cuda": _NO_SOFTMAX,
    "scaled_upper_triang_masked_softmax_cuda": _NO_SOFTMAX,
    "scaled_softmax_cuda": _NO_SOFTMAX,
    "apex": "apex's fused kernels are CUDA-only; Megatron uses torch norms and optimizers instead",
    "transformer_engine": "TransformerEngine is CUDA-only; Megatron uses its local transformer implementation",
    "flash_attn": "flash-attn is CUDA-only; the plugin's attention serves Megatron instead",
}


BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _batch_invariant_standin() -> ModuleType:
    """megatron-core's batch-invariant kernels are triton kernels, imported unconditionally by Megatron-LM's
    ``initialize``; without triton the stand-in imports and refuses the flag that would use them."""
    module = ModuleType(BATCH_INVARIANT, "devshim stand-in: batch-invariant mode needs triton")

    def enable_batch_invariant_mode(*args: Any, **kwargs: Any) -> None:
        raise ConfigError("--batch-invariant-mode needs megatron-core's triton kernels, and triton is not installed "
                          "here: drop the flag.")

    module.enable_batch_invariant_mode = enable_batch_invariant_mode  # type: ignore[attr-defined]  # a ModuleType built here
    module.is_batch_invariant_mode_enabled = lambda: False  # type: ignore[attr-defined]  # a ModuleType built here
    return module


def _deepspeed_compression_compat() -> ModuleType:
    """DeepSpeed 0.19 removed ``deepspeed.compression.compress``; Megatron-DeepSpeed imports two names from it
    unconditionally and calls them only when the DeepSpeed config asks for compression training."""
    module = ModuleType("deepspeed.compression.compress", "devshim compatibility module (removed in DeepSpeed 0.19)")

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise ConfigError("compression training (\"compression_training\" in the DeepSpeed config) was removed in "
                          "DeepSpeed 0.19; remove it from the config or use DeepSpeed < 0.19.")

    module.init_compression = module.redundancy_clean = unavailable  # type: ignore[attr-defined]  # a ModuleType built here
    return module


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def provided(device: Device) -> dict[str, ModuleType]:
    """``fused_weight_gradient_mlp_cuda`` on the plugin's ``wgrad_accumulate``, the fused-softmax extensions on its
    ``masked_softmax``, ``grouped_gemm`` on its ``grouped_gemm``, and the batch-invariant stand-in when triton is
    missing (the real module exists and imports triton)."""
    from devshim_core.integrations.megatron import grouped_gemm_module, softmax_modules
    from devshim_core.integrations.megatron.wgrad_module import make_module

    # grouped_gemm: a real one is a CUDA build; the stand-in runs the plugin's grouped_gemm for GroupedMLP
    modules = {"fused_weight_gradient_mlp_cuda": make_module(device), **softmax_modules.make_modules(device),
               **grouped_gemm_module.make_modules(device)}
    if _missing("triton"):
        modules[BATCH_INVARIANT] = _batch_invariant_standin()
    return modules


def fallbacks(device: Device) -> dict[str, ModuleType]:
    """Stand-ins served only when no real module of the name is found at import time (DeepSpeed >= 0.19 on
    ``sys.path``, or none)."""
    return {"deepspeed.compression.compress": _deepspeed_compression_compat()}
