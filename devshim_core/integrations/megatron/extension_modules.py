"""CUDA-only modules Megatron imports at import time: provided through the plugin, or blocked cleanly.

Megatron wraps these imports in ``try/except ImportError`` and takes a torch fallback when they fail. A CUDA
build of apex or TransformerEngine installed on a machine without CUDA does not fail that way: it imports,
then crashes or computes on the wrong device later. Blocking them makes the fallback certain.
"""

from __future__ import annotations

from types import ModuleType

from devshim_core.device import Device

_NO_CUDA = "a CUDA extension; devshim blocks it off CUDA so that Megatron takes its torch fallback"

BLOCKED: dict[str, str] = {
    "amp_C": _NO_CUDA,
    "fused_layer_norm_cuda": _NO_CUDA,
    "fused_mix_prec_layer_norm_cuda": _NO_CUDA,
    "scaled_masked_softmax_cuda": _NO_CUDA + " (the plugin's masked_softmax serves the fusion)",
    "scaled_upper_triang_masked_softmax_cuda": _NO_CUDA + " (the plugin's masked_softmax serves the fusion)",
    "scaled_softmax_cuda": _NO_CUDA + " (the plugin's masked_softmax serves the fusion)",
    "apex": "apex's fused kernels are CUDA-only; Megatron uses torch norms and optimizers instead",
    "transformer_engine": "TransformerEngine is CUDA-only; Megatron uses its local transformer implementation",
    "flash_attn": "flash-attn is CUDA-only; the plugin's attention serves Megatron instead",
}


def provided(device: Device) -> dict[str, ModuleType]:
    """``fused_weight_gradient_mlp_cuda``: gradient-accumulation fusion on the plugin's ``wgrad_accumulate``."""
    from devshim_core.integrations.megatron.wgrad_module import make_module

    return {"fused_weight_gradient_mlp_cuda": make_module(device)}
