"""Patch sets armed for the import of a module, each reported on a line of its own.

For integrations that improve a library rather than make it run (checkpoint checksums, HF's device names): a set whose
versions do not match is skipped with its reason, and activation goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from devshim_core import import_hooks
from devshim_core.device import Device
from devshim_core.integrations.base import Integration, Status
from devshim_core.patching import REGISTRY, PatchSet


@dataclass(frozen=True)
class ArmedSet:
    """``patch_set`` applied once ``module`` is imported; ``framework`` names it in the status lines (``armed: applied
    when FRAMEWORK is imported``, ``skipped: FRAMEWORK is not installed``), ``applied`` is the line once applied."""

    patch_set: PatchSet
    module: str
    framework: str
    present: Callable[[], bool]
    applied: str


def _apply(armed: ArmedSet, device: Device) -> str:
    problems = REGISTRY.check(armed.patch_set)
    if problems:  # another release: the library is left as it is
        return f"skipped: {'; '.join(problems)}"
    applied = REGISTRY.apply(armed.patch_set, device)
    return armed.applied if applied.disabled is None else f"skipped: {applied.disabled}"


def install(sets: Sequence[ArmedSet], device: Device, status: Status) -> None:
    for armed in sets:
        line = status.child(armed.patch_set.name)
        if not armed.present():
            line.set(f"skipped: {armed.framework} is not installed")
            continue

        def fire(imported: ModuleType, armed: ArmedSet = armed, line: Status = line) -> None:
            line.set(_apply(armed, device))

        if not import_hooks.after_import(armed.module, fire):
            line.set(f"armed: applied when {armed.framework} is imported")


def uninstall(sets: Sequence[ArmedSet]) -> None:
    for armed in reversed(sets):
        import_hooks.cancel(armed.module)
        REGISTRY.revert(armed.patch_set.name)


def integration(name: str, reason: str, sets: Sequence[ArmedSet], *, on_cuda: str,
                needs: tuple[str, ...] = ()) -> Integration:
    """The record of an integration made of armed sets only: triggered by their modules, standing aside on a CUDA
    device with the reason ``on_cuda``."""
    return Integration(
        name=name, reason=reason,
        install=lambda device, settings, status: install(sets, device, status),
        uninstall=lambda: uninstall(sets),
        needs=needs,
        triggers=tuple(dict.fromkeys(armed.module for armed in sets)),
        patch_sets=tuple(armed.patch_set.name for armed in sets),
        applies=lambda device, settings: on_cuda if device.type == "cuda" else None,
    )
