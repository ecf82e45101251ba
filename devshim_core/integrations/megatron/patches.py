"""Every change devshim makes to Megatron, declared in one place: target, version range, reason.

Three sets: ``megatron-extension-modules`` before Megatron is imported; ``megatron-core`` (megatron-core 0.16,
installed or Megatron-LM's checkout of it) when ``megatron.core`` has executed; ``megatron.training`` (see
``training``) when Megatron-LM's training stack is imported. Megatron-DeepSpeed's fork gets none of the
megatron-core patches: ``flavor`` tells them apart.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from devshim_core.device import Device
from devshim_core.integrations.megatron import extension_modules, pipeline_p2p, rng, unserved_flags
from devshim_core.integrations.megatron.flavor import CORE_0_12, CORE_0_16, MEGATRON_CORE, ImportedMegatronCore
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
# The in-place load of an fp32 parameter's shard without no_grad: in every release from core_r0.12.1 through
# core_v0.19.0; fixed on Megatron-LM's dev branch only (PR #5835, commit ceaa6c5d7e). The range names the releases
# known to have it.
STATE_COPY_WITHOUT_NO_GRAD = ImportedMegatronCore(spec=">=0.12.1,<0.20", gate=True)
# CORE_0_16: megatron-core 0.16's own bugs, absent from 0.12 (whose code around them differs). CORE_0_12:
# core_r0.12's, fixed in core_r0.13.0: its async checkpoint writer calls torch's _write_item without the
# serialization_format argument torch >= 2.7 requires; its distributed optimizer needs TE to quantize no fp8 params

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
            _dummy_optimizer_states(self)  # replaced in place by the load
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    sharded_state_dict.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return sharded_state_dict


def _dummy_optimizer_states(optimizer: Any) -> None:
    """Adam states for every parameter, from one step with zero gradients: Megatron >= 0.15's
    ``_init_optimizer_states_with_dummy_values``, written out where it does not exist (0.12)."""
    own = getattr(optimizer, "_init_optimizer_states_with_dummy_values", None)
    if own is not None:
        own()
        return
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            if param.numel():
                param.grad = torch.zeros_like(param)
    optimizer.optimizer.step()
    optimizer.optimizer.zero_grad()


def _write_item_with_format(original: Any, device: Device) -> Any:
    from torch.distributed.checkpoint import filesystem

    takes_format = "serialization_format" in inspect.signature(original).parameters
    torch_save = getattr(getattr(filesystem, "SerializationFormat", None), "TORCH_SAVE", None)

    def _write_item(*args: Any, **kwargs: Any) -> Any:
        if takes_format and torch_save is not None and "serialization_format" not in kwargs and len(args) == 5:
            kwargs["serialization_format"] = torch_save  # what core_r0.13's writer passes, and torch's default writer
        return original(*args, **kwargs)

    _write_item.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return _write_item


def _quantize_without_fp8_params(original: Any, device: Device) -> Any:
    def _quantize_param_shard_impl(model_params: Any, *args: Any, **kwargs: Any) -> Any:
        if not model_params:
            return None  # no fp8 parameter: nothing to quantize (what later releases do)
        return original(model_params, *args, **kwargs)  # TE's error: fp8 needs TransformerEngine

    _quantize_param_shard_impl.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return _quantize_param_shard_impl


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


def _with_current_step(optimizer: Any, model_param: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` plus the parameter's own Adam ``step`` where they lack one. Megatron copies every state torch's
    Adam holds, ``step`` included, but megatron-core 0.12's ``fully_sharded_model_space`` load leaves the step out
    (KeyError: 'step'; the checkpoint's step is its param group's, which ``distributed-optimizer-step-per-param``
    restores). Copying the step onto itself changes nothing."""
    index = getattr(optimizer, "model_param_group_index_map", {}).get(model_param)
    if "step" in tensors or index is None:
        return tensors
    group_index, group_order = index
    main_param = optimizer.optimizer.param_groups[group_index]["params"][group_order]
    step = optimizer.optimizer.state.get(main_param, {}).get("step")
    return tensors if step is None else {**tensors, "step": step}


def _state_copy_without_autograd(original: Any, device: Device) -> Any:
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: Any) -> Any:
        # With fp32 model parameters the distributed optimizer's main parameter is a view of the model parameter
        # (a leaf that requires grad), so the load's copy_ into it raises unless autograd is off. Upstream's fix
        # (Megatron-LM PR #5835) wraps the same copies in torch.no_grad().
        with torch.no_grad():
            return original(self, model_param, _with_current_step(self, model_param, tensors))

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
                     target=f"{RANDOM}:CheckpointWithoutOutput.__init__", make=_checkpoint_init, requires=(CORE_0_16,),
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
        SetAttribute(name="moe-router-gemm", target=f"{MOE_UTILS}:te_general_gemm", requires=(CORE_0_16,),
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
                            "through core_v0.19.0), runs these copies under no_grad; so does this. On 0.12 the "
                            "fully_sharded_model_space load also failed (KeyError: 'step'): each parameter keeps its "
                            "step, then takes the checkpoint's"),
        SetAttribute(name="async-checkpoint-write-format",
                     target="megatron.core.dist_checkpointing.strategies.filesystem_async:_write_item",
                     make=_write_item_with_format, requires=(CORE_0_12,),
                     reason="megatron-core 0.12's torch_dist writer calls torch's _write_item without the "
                            "serialization_format argument torch >= 2.7 requires: every dist_checkpointing save "
                            "failed with TypeError (on CUDA too). megatron-core 0.13 passes TORCH_SAVE; so does this"),
        SetAttribute(name="distributed-optimizer-without-fp8-params",
                     target="megatron.core.fp8_utils:_quantize_param_shard_impl",
                     make=_quantize_without_fp8_params, requires=(CORE_0_12,),
                     reason="megatron-core 0.12's distributed optimizer quantizes its fp8 parameters after every "
                            "step, and without TransformerEngine the quantizer raises even when there are none: "
                            "--use-distributed-optimizer failed at its first step off CUDA (and on CUDA without "
                            "TE). With no fp8 parameter there is nothing to do"),
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
