"""The fused-softmax CUDA extensions Megatron imports, on the device's ``masked_softmax`` kernel.

Megatron-DeepSpeed's ``megatron/model/fused_softmax.py`` (and megatron-core's, which devshim patches above these
modules) imports them inside its autograd functions, with no fallback, whenever ``masked_softmax_fusion`` is on (the
default) and the scores are fp16 or bf16. Each module has the CUDA extension's functions and semantics:

- ``scaled_masked_softmax_cuda.forward(inputs [b, np, sq, sk], mask [b|1, 1, sq, sk] (True/1 = masked), scale)``:
  ``softmax(inputs * scale)`` with masked positions filled with -10000.0; ``backward(output_grads, softmax_results,
  scale)``: the gradient of the scores; ``get_batch_per_block(sq, sk, b, np)``: the CUDA kernel's batches per thread
  block, which Megatron's ``is_kernel_available`` divides by (returned as CUDA computes it, so that the same branch is
  taken as on a GPU);
- ``scaled_upper_triang_masked_softmax_cuda.forward(inputs [attn_batches, sq, sk], scale)``: causal, key j > query i
  masked; ``backward(output_grads, softmax_results, scale)``;
- ``scaled_softmax_cuda.forward(inputs [b, np, sq, sk], scale)``: no mask; ``backward`` likewise.

Forward runs the plugin's kernel (statistics in fp32, the result in the scores' dtype); backward is the softmax
gradient ``scale * y * (g - sum(g * y))`` in fp32, from the saved results as the CUDA kernels compute it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from devshim_core.device import Device

MASKED, UPPER_TRIANG, UNMASKED = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                                  "scaled_softmax_cuda")
MODULE_NAMES = (MASKED, UPPER_TRIANG, UNMASKED)
_WARP_SIZE, _THREADS_PER_BLOCK = 32, 128  # the CUDA kernels' launch constants (scaled_masked_softmax.h)


def get_batch_per_block(query_seq_len: int, key_seq_len: int, batches: int, attn_heads: int) -> int:
    """What the CUDA extension returns: rows per thread block for a key length (Megatron checks divisibility)."""
    next_power_of_two = 1 << max(key_seq_len - 1, 0).bit_length()
    warp_size = min(next_power_of_two, _WARP_SIZE)
    batches_per_warp = 2 if next_power_of_two <= 128 else 1
    return (_THREADS_PER_BLOCK // warp_size) * batches_per_warp


def softmax_backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float) -> torch.Tensor:
    """d(scores) for ``y = softmax(scores * scale)`` given ``dy``: ``scale * y * (dy - sum(dy * y))``, in fp32."""
    grads, results = output_grads.float(), softmax_results.float()
    inner = (grads * results).sum(dim=-1, keepdim=True)
    return (scale * results * (grads - inner)).to(output_grads.dtype)


def make_modules(device: Device) -> dict[str, types.ModuleType]:
    """The three modules on ``device.attention.masked_softmax``; none if the plugin has no such kernel (they stay
    blocked then, and Megatron's unfused softmax runs where Megatron has a fallback)."""
    kernel = device.attention.masked_softmax
    if kernel is None:
        return {}

    def as_mask(mask: torch.Tensor) -> torch.Tensor:
        return mask if mask.dtype == torch.bool else mask.bool()  # the CUDA kernel reads uint8 masks as 0/1

    def masked_forward(inputs: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        return kernel(inputs, as_mask(mask), float(scale))

    def upper_triang_forward(inputs: torch.Tensor, scale: float) -> torch.Tensor:
        return kernel(inputs.unsqueeze(1), None, float(scale), causal=True).squeeze(1)

    def unmasked_forward(inputs: torch.Tensor, scale: float) -> torch.Tensor:
        return kernel(inputs, None, float(scale))

    functions: dict[str, dict[str, Callable[..., object]]] = {
        MASKED: {"forward": masked_forward, "backward": softmax_backward, "get_batch_per_block": get_batch_per_block},
        UPPER_TRIANG: {"forward": upper_triang_forward, "backward": softmax_backward},
        UNMASKED: {"forward": unmasked_forward, "backward": softmax_backward},
    }
    modules = {}
    for name, members in functions.items():
        module = types.ModuleType(name, f"Megatron's {name} extension on devshim's {device.plugin} device "
                                        "(device.attention.masked_softmax).")
        for attr, function in members.items():
            setattr(module, attr, function)
        module.devshim_plugin = device.plugin  # type: ignore[attr-defined]  # for reports: whose kernel this is
        modules[name] = module
    return modules
