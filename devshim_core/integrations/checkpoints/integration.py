"""The checkpoints integration's record: its sets armed for the moment DeepSpeed's checkpoint engine or megatron-core's
``dist_checkpointing`` is imported, each reported on a line of its own."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import ModuleType

from devshim_core import import_hooks
from devshim_core.device import Device
from devshim_core.integrations.base import Integration, Status
from devshim_core.integrations.checkpoints.patches import (
    DEEPSPEED_CHECKPOINTS,
    ENGINE_MODULE,
    MEGATRON_CHECKPOINTS,
    PACKAGE,
)
from devshim_core.patching import REGISTRY, PatchSet
from devshim_core.settings import Settings

APPLIED = "applied (each checkpoint file's sha256 recorded in .devshim-checksums and checked before it is loaded)"


def _deepspeed_present() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _megatron_present() -> bool:
    from devshim_core.integrations.megatron.install import _megatron_present as present  # never runs the package

    return present()


# (set, the module whose import applies it, the framework's name, whether it is there)
_ARMED: tuple[tuple[PatchSet, str, str, Callable[[], bool]], ...] = (
    (DEEPSPEED_CHECKPOINTS, ENGINE_MODULE, "deepspeed", _deepspeed_present),
    (MEGATRON_CHECKPOINTS, PACKAGE, "megatron.core", _megatron_present),
)


def _apply(patch_set: PatchSet, device: Device) -> str:
    problems = REGISTRY.check(patch_set)
    if problems:  # another release, or Megatron-DeepSpeed's fork: its checkpoints are left as they are
        return f"skipped: {'; '.join(problems)}"
    applied = REGISTRY.apply(patch_set, device)
    return APPLIED if applied.disabled is None else f"skipped: {applied.disabled}"


def _install(device: Device, settings: Settings, status: Status) -> None:
    for patch_set, module, framework, present in _ARMED:
        line = status.child(patch_set.name)
        if not present():
            line.set(f"skipped: {framework} is not installed")
            continue

        def fire(imported: ModuleType, patch_set: PatchSet = patch_set, line: Status = line) -> None:
            line.set(_apply(patch_set, device))

        if not import_hooks.after_import(module, fire):
            line.set(f"armed: applied when {framework} is imported")


def _uninstall() -> None:
    for patch_set, module, _, _ in reversed(_ARMED):
        import_hooks.cancel(module)
        REGISTRY.revert(patch_set.name)


def _applies(device: Device, settings: Settings) -> str | None:
    if device.type == "cuda":
        return "the device is CUDA, where devshim stands aside: DeepSpeed and Megatron save and load as they do"
    return None


INTEGRATION = Integration(
    name="checkpoints",
    reason="DeepSpeed and megatron-core checkpoints never load wrong (sha256 checked before a load), and a save that "
           "runs out of room names the path",
    install=_install,
    uninstall=_uninstall,
    triggers=(ENGINE_MODULE, PACKAGE),
    patch_sets=(DEEPSPEED_CHECKPOINTS.name, MEGATRON_CHECKPOINTS.name),
    applies=_applies,
)
