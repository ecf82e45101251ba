"""apex's ``amp_C`` multi-tensor ops, which Megatron's gradient clipping and mixed-precision copies call through
``multi_tensor_applier``, as torch's ``_foreach`` ops on the device.

Without apex or TransformerEngine (always, off CUDA) Megatron falls back to ``megatron.core.utils``'
``local_multi_tensor_*``: a Python loop that scales each gradient into a new tensor and copies it back (two passes
and an allocation per tensor), and a norm gathered on the host. These take the same arguments and return the
same values as those fallbacks.
"""

from __future__ import annotations

from typing import Any

import torch

from devshim_core.patching import Patch, SetAttribute, SetAttributes

Tensor = torch.Tensor
CLIP_GRADS = "megatron.core.optimizer.clip_grads"
OPTIMIZER = "megatron.core.optimizer.optimizer"


def multi_tensor_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], per_tensor: bool,
                        *args: Any) -> tuple[Tensor, Tensor | None]:
    """``amp_C.multi_tensor_l2norm``: the 2-norm of all of ``tensor_lists[0]`` as a 1-element fp32 tensor on their
    device, and the per-tensor norms when ``per_tensor``."""
    if not tensor_lists[0]:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensor_lists[0])).float()
    return torch.linalg.vector_norm(norms).reshape(1), norms if per_tensor else None


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], scale: float) -> None:
    """``amp_C.multi_tensor_scale``: ``dst = src * scale`` for each pair of ``tensor_lists = [sources, targets]``
    (in place, one pass, when they are the same tensors; a cast when the dtypes differ)."""
    sources, targets = tensor_lists
    if not targets:
        return
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        torch._foreach_mul_(targets, scale)
    elif scale == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def multi_tensor_patches() -> list[Patch]:
    return [
        SetAttributes(
            name="multi-tensor-clip-grads", target=CLIP_GRADS, names=("l2_norm_impl", "multi_tensor_scale_impl"),
            make=lambda originals, d: {"l2_norm_impl": multi_tensor_l2norm,
                                       "multi_tensor_scale_impl": multi_tensor_scale},
            reason="gradient clipping's norm and scale run as foreach ops on the device, as apex's amp_C does on "
                   "CUDA, instead of Megatron's per-tensor fallback (scale into a new tensor, copy back)"),
        SetAttribute(
            name="multi-tensor-copy", target=f"{OPTIMIZER}:multi_tensor_scale_impl",
            make=lambda original, d: multi_tensor_scale,
            reason="mixed-precision optimizers copy main params to model params with the same foreach scale"),
    ]
