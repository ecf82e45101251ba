"""Every change devshim makes to Megatron, declared in one place: target, version range, reason.

Three sets: ``megatron-extension-modules`` before Megatron is imported; ``megatron-core`` (megatron-core 0.16,
installed or Megatron-LM's checkout of it) when ``megatron.core`` has executed; ``megatron.training`` (see
``training``) when Megatron-LM's training stack is imported. Megatron-DeepSpeed's fork gets none of the
megatron-core patches: ``flavor`` tells them apart.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from devshim_core.device import Device
from devshim_core.integrations.megatron import extension_modules, pipeline_p2p, rng, unserved_flags
from devshim_core.integrations.megatron.flavor import MEGATRON_CORE, ImportedMegatronCore
from devshim_core.patching import (
    Patch,
    PatchSet,
    ProvideModules,
    RebindReferences,
    SetAttribute,
    replaced_functions,
)

RANDOM = "megatron.core.tensor_parallel.random"
LAYERS = "megatron.core.tensor_parallel.layers"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"
# The in-place load of an fp32 parameter's shard without no_grad: in every release through core_v0.19.0; fixed on
# Megatron-LM's dev branch only (PR #5835, commit ceaa6c5d7e). The range names the releases known to have it.
STATE_COPY_WITHOUT_NO_GRAD = ImportedMegatronCore(spec=">=0.16,<0.20")

EXTENSION_MODULES = PatchSet(
    name="megatron-extension-modules",
    requires=(),
    reason="Megatron imports CUDA extensions at import time; they must be provided or blocked before it does",
    patches=(ProvideModules(
        name="cuda-extension-modules", modules=extension_modules.provided, blocked=extension_modules.BLOCKED,
        fallbacks=extension_modules.fallbacks,
        reason="fused_weight_gradient_mlp_cuda runs on the plugin's wgrad_accumulate, the fused-softmax extensions "
               "(which Megatron-DeepSpeed imports with no fallback in fp16/bf16) on its masked_softmax, grouped_gemm "
               "on its grouped_gemm; CUDA builds of apex, TransformerEngine and flash-attn fail as not installed, so "
               "Megatron takes its torch fallbacks; DeepSpeed >= 0.19's missing compression module, which "
               "Megatron-DeepSpeed imports, is a stand-in that refuses compression training"),),
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

    __init__.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return __init__


def _te_min_version(original: Any, device: Device) -> Any:
    utils = sys.modules["megatron.core.utils"]

    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        if utils.get_te_version() is None:
            return False
        return original(version, check_equality)

    is_te_min_version.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return is_te_min_version


def _move_to_host(original: Any, device: Device) -> Any:
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if not torch.is_tensor(tensor) or tensor.device.type not in (device.type, "cuda"):
            return tensor
        host = tensor.to(torch.device("cpu"), non_blocking=True)
        if record_stream and tensor.device.type != "cpu":
            tensor.record_stream(device.current_stream())
        return host.numpy() if as_numpy else host

    maybe_move_tensor_to_cpu.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return maybe_move_tensor_to_cpu


def _load_ready_sharded_state_dict(original: Any, device: Device) -> Any:
    distrib = sys.modules["megatron.core.optimizer.distrib_optimizer"]

    def sharded_state_dict(self: Any, model_sharded_state_dict: Any, is_loading: bool = False, *args: Any,
                           **kwargs: Any) -> Any:
        if is_loading and not distrib.HAVE_APEX_OR_TE and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()  # replaced in place by the load
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    sharded_state_dict.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return sharded_state_dict


def _checkpoint_steps(original: Any, device: Device) -> Any:
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        result = original(self, state_dict)
        # The checkpoint's iteration is the param group's "step" (what state_dict() wrote). Megatron gives all
        # parameters one shared tensor of it, and the dp_reshardable load then copies each parameter's placeholder
        # step (from the dummy states) over it.
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                step = state.get("step")
                if torch.is_tensor(step):
                    value = group.get("step", step)
                    state["step"] = torch.tensor(float(value), dtype=step.dtype, device=step.device)
        return result

    load_state_dict.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return load_state_dict


def _state_copy_without_autograd(original: Any, device: Device) -> Any:
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: Any) -> Any:
        # With fp32 model parameters the distributed optimizer's main parameter is a view of the model parameter
        # (a leaf that requires grad), so the load's copy_ into it raises unless autograd is off. Upstream's fix
        # (Megatron-LM PR #5835) wraps the same copies in torch.no_grad().
        with torch.no_grad():
            return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return _set_main_param_and_optimizer_states


def core_patches(device: Device) -> list[Patch]:
    from devshim_core.integrations.megatron.fused_adam import optimizer_patches
    from devshim_core.integrations.megatron.fused_ops import fused_patches
    from devshim_core.integrations.megatron.multi_tensor import multi_tensor_patches

    has_wgrad = getattr(device.attention, "wgrad_accumulate", None) is not None
    return [
        SetAttribute(
            name="refuse-unserved-flags",
            target="megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
            make=unserved_flags.checked_post_init,
            reason="every config field the device cannot serve (TransformerEngine, CUDA graphs, DeepEP, flash "
                   "attention, ...; unserved_flags.CONFIG_FIELDS) fails with its name and flag before the model "
                   "is built"),
        SetAttribute(name="get-rng-state", target=f"{RANDOM}:_get_cuda_rng_state", make=rng.get_state,
                     reason="the tensor-parallel RNG tracker reads the plugin's generator"),
        SetAttribute(name="set-rng-state", target=f"{RANDOM}:_set_cuda_rng_state", make=rng.set_state,
                     reason="_lazy_call never runs off CUDA: fork() would silently never restore the RNG state"),
        RebindReferences(name="rng-state-references", scope="megatron",
                         pairs=replaced_functions(f"{RANDOM}:_get_cuda_rng_state", f"{RANDOM}:_set_cuda_rng_state"),
                         reason="modules that imported the two RNG helpers by name"),
        SetAttribute(name="checkpoint-without-output-fp8",
                     target=f"{RANDOM}:CheckpointWithoutOutput.__init__", make=_checkpoint_init,
                     reason="megatron-core 0.16.1 turns fp8=False into fp8=True and then needs TransformerEngine "
                            "(NameError: FP8GlobalStateManager) in selective recompute"),
        SetAttribute(name="grad-accum-fusion-module", target=f"{LAYERS}:fused_weight_gradient_mlp_cuda",
                     make=_wgrad_module,
                     reason="gradient_accumulation_fusion calls this module; it runs the plugin's wgrad_accumulate "
                            "(bound here too when Megatron was imported before devshim)",
                     creates=True),  # absent when Megatron was imported first: its `import` of the module failed
        SetAttribute(name="grad-accum-fusion-available", target=f"{LAYERS}:_grad_accum_fusion_available",
                     make=lambda original, d: True if has_wgrad else original,
                     reason="gradient_accumulation_fusion is available exactly when the plugin provides "
                            "wgrad_accumulate; otherwise Megatron's own error names the flag"),
        SetAttribute(name="te-version-check", target="megatron.core.utils:is_te_min_version",
                     make=_te_min_version,
                     reason="compares None >= Version (TypeError) when TransformerEngine is absent; absent is 'no'"),
        RebindReferences(name="te-version-check-references", scope="megatron",
                         pairs=replaced_functions("megatron.core.utils:is_te_min_version"),
                         reason="most of megatron imports is_te_min_version by name"),
        SetAttribute(name="moe-router-gemm", target=f"{MOE_UTILS}:te_general_gemm",
                     make=lambda original, d: original,  # None when TE is absent: the router's torch path
                     reason="megatron-core 0.16.1 defines te_general_gemm only when TE imports; the MoE router then "
                            "raises NameError instead of taking its torch.mm path", creates=True),
        SetAttribute(name="moe-splits-to-host", target=f"{MOE_UTILS}:maybe_move_tensor_to_cpu",
                     make=_move_to_host,
                     reason="the all-to-all token dispatcher moves split sizes to the host only if `.is_cuda`; on "
                            "another device they stay tensors and all_to_all_single rejects them"),
        RebindReferences(name="moe-splits-to-host-references", scope="megatron.core.transformer.moe",
                         pairs=replaced_functions(f"{MOE_UTILS}:maybe_move_tensor_to_cpu"),
                         reason="token_dispatcher imports it by name"),
        SetAttribute(name="distributed-optimizer-load-state",
                     target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict",
                     make=_load_ready_sharded_state_dict,
                     reason="without apex or TE (always, off CUDA) state_dict() asserts one Adam step exists; a "
                            "fresh optimizer that loads a checkpoint has none yet (Megatron-FSDP's path seeds dummy "
                            "states first; the same is done here)"),
        SetAttribute(name="distributed-optimizer-step-per-param",
                     target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict",
                     make=_checkpoint_steps,
                     reason="without apex or TE, a load gives every parameter's Adam state one shared `step` tensor "
                            "(torch's Adam increments it once per parameter) and the dp_reshardable load then "
                            "overwrites it with the placeholder step; each parameter gets its own, the checkpoint's. "
                            "Either way a resume silently trains with the wrong bias correction"),
        SetAttribute(name="distributed-optimizer-load-without-autograd",
                     target=f"{DISTRIB_OPTIMIZER}:DistributedOptimizer._set_main_param_and_optimizer_states",
                     make=_state_copy_without_autograd, requires=(STATE_COPY_WITHOUT_NO_GRAD,),
                     reason="with fp32 parameters (no --bf16/--fp16) every resume through Megatron-LM's "
                            "load_checkpoint crashed: load_parameter_state_from_dp_reshardable (torch_dist's default "
                            "sharding) copies into views of the parameters without torch.no_grad ('a view of a leaf "
                            "Variable that requires grad is being used in an in-place operation'), on any device. "
                            "Upstream's fix, Megatron-LM PR #5835 (commit ceaa6c5d7e, dev branch; not in a release "
                            "through core_v0.19.0), runs these copies under no_grad; so does this"),
        SetAttribute(name="pipeline-p2p-tags",
                     target="megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops",
                     make=pipeline_p2p.batched_p2p_ops,
                     reason="with 2 pipeline ranks, untagged batched transfers pair activations with gradients "
                            "on gloo-staged backends (silently wrong interleaved-PP training); tag by direction"),
        *fused_patches(device),
        *optimizer_patches(device),
        *multi_tensor_patches(),
    ]


def core_patch_set(device: Device) -> PatchSet:
    return PatchSet(name="megatron-core", requires=(MEGATRON_CORE,), patches=tuple(core_patches(device)),
                    reason=f"run megatron-core on {device.type} through the {device.plugin} plugin")
