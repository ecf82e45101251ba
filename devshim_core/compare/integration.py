"""The ``compare`` integration: installs the recorder of ``devshim compare`` when ``DEVSHIM_COMPARE_DIR`` is set.

Its one patch set, ``compare-recorder``, registers torch's global module, tensor and optimizer hooks
(:mod:`devshim_core.compare.recorder`); undoing it removes them and closes the dump. Nothing of torch, DeepSpeed or
Megatron is replaced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from devshim_core.compare import names, recorder
from devshim_core.integrations.base import Integration, Status
from devshim_core.patching import REGISTRY, Patch, PatchSet, Undo

if TYPE_CHECKING:
    from devshim_core.device import Device
    from devshim_core.settings import Settings


@dataclass(frozen=True)
class RegisterRecorder(Patch):
    """Register the recorder's global hooks (torch's module, tensor and optimizer hooks); undo removes them."""

    name: str = "global-hooks"
    reason: str = "devshim compare records every module's outputs and gradients and every optimizer step"

    def target_description(self) -> str:
        return ("torch.nn.modules.module.register_module_forward_[pre_]hook, "
                "torch.optim.optimizer.register_optimizer_step_{pre,post}_hook")

    def apply(self, device: Device) -> tuple[Undo, str]:
        found = recorder.from_environment(os.environ, {
            "plugin": device.plugin, "device_type": device.type,
            "kernel_sources": {"optimizer": device.optimizer.source, "attention": device.attention.source}})
        if found is None:  # applies() let it through: DEVSHIM_COMPARE_DIR was set then
            return (lambda: None), "nothing to record: DEVSHIM_COMPARE_DIR is unset"
        found.install()
        return found.uninstall, f"recording into {found.writer.directory}"


RECORDER = PatchSet(name="compare-recorder", requires=(), patches=(RegisterRecorder(),),
                    reason="devshim compare: record this run, layer by layer, for the comparison")


def _install(device: Device, settings: Settings, status: Status) -> None:
    applied = REGISTRY.apply(RECORDER, device)
    status.set(f"applied ({applied.applied[0].detail})" if applied.disabled is None and applied.applied
               else f"skipped: {applied.disabled}")


INTEGRATION = Integration(
    name="compare",
    reason="devshim compare's recorder: every module's outputs and gradients, every optimizer step",
    install=_install,
    uninstall=lambda: None,  # the registry reverts its set
    patch_sets=(RECORDER.name,),
    applies=lambda device, settings: None if os.environ.get(names.DIR, "").strip() else (
        f"{names.DIR} is unset (devshim compare sets it)"),
)
