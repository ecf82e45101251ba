"""Every change devshim makes to Megatron, declared in one place: target, version range, reason.

Three sets: ``megatron:extension-modules`` before Megatron is imported; ``megatron-core`` (megatron-core 0.16,
installed or Megatron-LM's checkout of it) when ``megatron.core`` has executed; ``megatron.training`` (see
``training``) when Megatron-LM's training stack is imported. Megatron-DeepSpeed's fork gets none of the
megatron-core patches: ``flavor`` tells them apart.
"""

from __future__ import annotations

import sys
from typing import Any

from devshim_core.device import Device
from devshim_core.integrations.megatron import extension_modules, pipeline_p2p, rng, unserved_flags
from devshim_core.integrations.megatron.flavor import MEGATRON_CORE
from devshim_core.patching import Patch, PatchSet, ProvideModules, RebindReferences, SetAttribute

RANDOM = "megatron.core.tensor_parallel.random"
LAYERS = "megatron.core.tensor_parallel.layers"

EXTENSION_MODULES = PatchSet(
    name="megatron:extension-modules",
    requires=(),
    reason="Megatron imports CUDA extensions at import time; they must be provided or blocked before it does",
    patches=(ProvideModules(
        name="cuda-extension-modules", modules=extension_modules.provided, blocked=extension_modules.BLOCKED,
        reason="fused_weight_gradient_mlp_cuda runs on the plugin's wgrad_accumulate; CUDA builds of apex, "
               "TransformerEngine, flash-attn and the fused-softmax extensions fail as not installed, so "
               "Megatron takes its torch fallbacks"),),
)


def _wgrad_module(original: Any, device: Device) -> Any:
    return sys.modules.get("fused_weight_gradient_mlp_cuda") or extension_modules.provided(device)[
        "fused_weight_gradient_mlp_cuda"]


def _checkpoint_init(original: Any, device: Device) -> Any:
    random = sys.modules[RANDOM]

    def __init__(self: Any, fp8: Any = False) -> None:
        original(self, fp8)
        if not random.HAVE_TE:  # 0.16.1 sets fp8 = (fp8 is not None): True for fp8=False, then needs TE
            self.fp8 = bool(fp8)

    __init__.__devshim_original__ = original  # type: ignore[attr-defined]
    return __init__


def _rng_pairs(device: Device) -> list[tuple[Any, Any]]:
    random = sys.modules[RANDOM]
    return [(getattr(new, "__devshim_original__", None), new)
            for new in (random._get_cuda_rng_state, random._set_cuda_rng_state)]


def core_patches(device: Device) -> list[Patch]:
    from devshim_core.integrations.megatron.fused_ops import fused_patches

    has_wgrad = getattr(device.attention, "wgrad_accumulate", None) is not None
    return [
        SetAttribute(
            name="refuse-unserved-flags",
            target="megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
            make=lambda original, d: unserved_flags.checked_post_init(original, d.type),
            reason="fp8/fp4, CUDA graphs and other TransformerEngine-only flags fail with the flag's name, at once"),
        SetAttribute(name="get-rng-state", target=f"{RANDOM}:_get_cuda_rng_state", make=rng.get_state,
                     reason="the tensor-parallel RNG tracker reads the plugin's generator"),
        SetAttribute(name="set-rng-state", target=f"{RANDOM}:_set_cuda_rng_state", make=rng.set_state,
                     reason="_lazy_call never runs off CUDA: fork() would silently never restore the RNG state"),
        RebindReferences(name="rng-state-references", scope="megatron", pairs=_rng_pairs,
                         reason="modules that imported the two RNG helpers by name"),
        SetAttribute(name="checkpoint-without-output-fp8",
                     target=f"{RANDOM}:CheckpointWithoutOutput.__init__", make=_checkpoint_init,
                     reason="megatron-core 0.16.1 turns fp8=False into fp8=True and then needs TransformerEngine "
                            "(NameError: FP8GlobalStateManager) in selective recompute"),
        SetAttribute(name="grad-accum-fusion-module", target=f"{LAYERS}:fused_weight_gradient_mlp_cuda",
                     make=_wgrad_module,
                     reason="gradient_accumulation_fusion calls this module; it runs the plugin's wgrad_accumulate "
                            "(bound here too when Megatron was imported before devshim)"),
        SetAttribute(name="grad-accum-fusion-available", target=f"{LAYERS}:_grad_accum_fusion_available",
                     make=lambda original, d: True if has_wgrad else original,
                     reason="gradient_accumulation_fusion is available exactly when the plugin provides "
                            "wgrad_accumulate; otherwise Megatron's own error names the flag"),
        SetAttribute(name="pipeline-p2p-tags",
                     target="megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops",
                     make=pipeline_p2p.batched_p2p_ops,
                     reason="with 2 pipeline ranks, untagged batched transfers pair activations with gradients "
                            "on gloo-staged backends (silently wrong interleaved-PP training); tag by direction"),
        *fused_patches(device),
    ]


def core_patch_set(device: Device) -> PatchSet:
    return PatchSet(name="megatron-core", requires=(MEGATRON_CORE,), patches=tuple(core_patches(device)),
                    reason=f"run megatron-core on {device.type} through the {device.plugin} plugin")
