"""Install the Megatron patch sets now, or the moment Megatron is imported."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING

from devshim_core import import_hooks
from devshim_core.device import Device
from devshim_core.errors import PatchError
from devshim_core.integrations.base import Status
from devshim_core.integrations.megatron import flavor
from devshim_core.integrations.megatron.patches import EXTENSION_MODULES, core_patch_set
from devshim_core.patching import REGISTRY

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

CORE = "megatron.core"
JIT = "megatron.core.jit"
TRAINING = "megatron.training"


def _megatron_present() -> bool:
    """Without importing it: find_spec('megatron.core') would run the ``megatron`` package, and Megatron-DeepSpeed's
    imports its tensor-parallel layers (and DeepSpeed) before the extension modules are provided."""
    if CORE in sys.modules:
        return True
    try:
        spec = importlib.util.find_spec("megatron")  # top level: the package is found, not run
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(os.path.isdir(os.path.join(p, "core")) for p in spec.submodule_search_locations)


def _on_core_imported(device: Device, status: Status) -> None:
    if flavor.is_megatron_deepspeed():
        # the fork is accelerator-aware (get_accelerator()): DeepSpeed's integration and the CUDA redirect serve
        # it, with the extension modules provided; megatron-core 0.16's patches would break it
        status.set("Megatron-DeepSpeed recognised: its megatron.core fork gets no megatron-core patches; the "
                   "DeepSpeed integration and the CUDA redirect serve it")
        return
    applied = REGISTRY.apply(core_patch_set(device), device)
    status.set("applied" if applied.disabled is None else f"skipped: {applied.disabled}")


def _on_jit_imported(device: Device, status: Status) -> None:
    from devshim_core.integrations.megatron.jit import compiles_for, jit_patch_set

    if not flavor.is_megatron_deepspeed() and not compiles_for(device.type):
        REGISTRY.apply(jit_patch_set(device), device)


def _on_training_imported(device: Device, status: Status) -> None:
    if flavor.is_megatron_core():
        from devshim_core.integrations.megatron.training import training_patch_set
        from devshim_core.integrations.megatron.unserved_args import args_patch_set

        REGISTRY.apply(training_patch_set(device), device)
        REGISTRY.apply(args_patch_set(device), device)  # wraps training's validate_args: reverted before it


def install(device: Device, status: Status) -> None:
    """Provide the extension modules, then apply (or arm) the set matching the Megatron that is imported, reporting
    through ``status``."""
    status.set(_install(device, status))


def _install(device: Device, status: Status) -> str:
    if not _megatron_present():
        return "skipped: megatron is not importable"
    REGISTRY.apply(EXTENSION_MODULES, device)
    imported_first = import_hooks.is_imported(CORE)
    problem = flavor.MEGATRON_CORE.problem() if imported_first and flavor.is_megatron_core() else None
    if problem is not None:
        raise PatchError(f"devshim's Megatron integration cannot run: {problem}. Install megatron-core"
                         f"{flavor.MEGATRON_CORE.spec}, or set DEVSHIM_PATCH_MEGATRON=0 to run without it.")
    hooks = ((JIT, _on_jit_imported), (CORE, _on_core_imported), (TRAINING, _on_training_imported))
    for name, callback in hooks:
        def hook(module: ModuleType, callback: Callable[[Device, Status], None] = callback) -> None:
            callback(device, status)

        import_hooks.after_import(name, hook)
    if imported_first:
        if flavor.is_megatron_deepspeed():
            return "Megatron-DeepSpeed recognised: no megatron-core patches"
        return "applied (megatron was imported first: import-time references were rebound)"
    return "armed: applied when megatron.core is imported"


def uninstall() -> None:
    for name in (JIT, CORE, TRAINING):
        import_hooks.cancel(name)
    for name in ("megatron-training-flags", "megatron-training", "megatron-core", "megatron-core-jit",
                 EXTENSION_MODULES.name):
        REGISTRY.revert(name)
