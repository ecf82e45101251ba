"""Megatron-LM's training stack (``megatron.training``, from a Megatron-LM checkout) on a devshim device.

Applied when ``megatron.training`` is imported. ``pretrain_gpt.py`` then runs unmodified but for
``import devshim_core.auto`` on its first line, with its default ``--distributed-backend nccl`` (the CUDA
redirect maps it) and default ``--transformer-impl transformer_engine`` (local, when TE is absent).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.integrations.megatron.flavor import MEGATRON_CORE
from devshim_core.patching import (
    Patch,
    PatchSet,
    RebindReferences,
    SetAttribute,
    SetEnvironment,
    replaced_functions,
)

INITIALIZE = "megatron.training.initialize"
ARGUMENTS = "megatron.training.arguments"


def _have_transformer_engine() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):  # blocked by devshim off CUDA, or a broken install
        return False


def _validate_args(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def validate_args(args: Any, defaults: dict[str, Any] | None = None) -> Any:
        if getattr(args, "profile", False) and not getattr(args, "use_pytorch_profiler", False):
            # without it Megatron calls torch.cuda.cudart().cudaProfilerStart() at --profile-step-start
            raise ValueError(
                f"--profile without --use-pytorch-profiler drives Nsight Systems through the CUDA runtime, which "
                f"{device.type} does not have. Add --use-pytorch-profiler --tensorboard-dir DIR: torch.profiler "
                f"then records steps --profile-step-start..--profile-step-end on --profile-ranks through the "
                f"plugin's device and writes one trace per rank to DIR")
        if getattr(args, "transformer_impl", None) == "transformer_engine" and not _have_transformer_engine():
            args.transformer_impl = "local"
            if getattr(args, "rank", 0) == 0:
                print(f"devshim: TransformerEngine is not available on {device.type}: --transformer-impl "
                      "transformer_engine -> local (Megatron's own modules, on the plugin's fused kernels)",
                      flush=True)
        return original(args, defaults or {})

    validate_args.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return validate_args


def _compile_dependencies(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def _compile_dependencies() -> None:
        # the dataset index helpers ship compiled with megatron-core; Megatron-LM rebuilds them with `make` in
        # the installed package, which has no Makefile. The legacy fused kernels are CUDA sources: never built.
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            from megatron.core.datasets.utils import compile_helpers

            compile_helpers()

    _compile_dependencies.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return _compile_dependencies


def _skip_jit_warmup(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def _warmup_jit_function() -> None:
        return None  # warms CUDA fusers for CUDA dtypes; off CUDA the fused functions compile on first use

    _warmup_jit_function.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return _warmup_jit_function


def training_patches() -> list[Patch]:
    return [
        SetEnvironment(
            name="cuda-device-max-connections", values={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
            reason="validate_args asserts it for TP/CP below Blackwell (the device reports arch 0); it orders CUDA "
                   "work queues and means nothing off CUDA"),
        SetAttribute(name="validate-args", target=f"{ARGUMENTS}:validate_args", make=_validate_args,
                     reason="the default --transformer-impl transformer_engine needs TE; without it, local. "
                            "--profile without --use-pytorch-profiler (Nsight via the CUDA runtime) is refused by "
                            "name at once, not at --profile-step-start"),
        SetAttribute(name="compile-dependencies", target=f"{INITIALIZE}:_compile_dependencies",
                     make=_compile_dependencies,
                     reason="rank 0 runs `make` in the installed megatron-core (no Makefile: the others hang at the "
                            "barrier) and loads CUDA fused kernels"),
        SetAttribute(name="jit-warmup", target=f"{INITIALIZE}:_warmup_jit_function", make=_skip_jit_warmup,
                     reason="warms up CUDA JIT fusers on device='cuda' with CUDA dtypes"),
        RebindReferences(name="training-references", scope="megatron",
                         pairs=replaced_functions(f"{ARGUMENTS}:validate_args", f"{INITIALIZE}:_compile_dependencies",
                                                  f"{INITIALIZE}:_warmup_jit_function"),
                         reason="initialize.py imports validate_args by name"),
    ]


def training_patch_set(device: Device) -> PatchSet:
    return PatchSet(name="megatron-training", requires=(MEGATRON_CORE,), patches=tuple(training_patches()),
                    reason=f"run Megatron-LM's training stack (pretrain_gpt.py) on {device.type}")
