"""The Megatron integration's record: megatron-core, Megatron-LM's training and Megatron-DeepSpeed's fork."""

from __future__ import annotations

from devshim_core.device import Device
from devshim_core.integrations.base import Integration, Status
from devshim_core.integrations.megatron.flavor import MEGATRON_CORE
from devshim_core.integrations.megatron.install import CORE, JIT, TRAINING
from devshim_core.integrations.megatron.patches import EXTENSION_MODULES
from devshim_core.settings import Settings


def _install(device: Device, settings: Settings, status: Status) -> None:
    from devshim_core.integrations.megatron.install import install

    install(device, status)


def _uninstall() -> None:
    from devshim_core.integrations.megatron.install import uninstall

    uninstall()


def _applies(device: Device, settings: Settings) -> str | None:
    return "the device is CUDA, where Megatron runs its own CUDA paths" if device.type == "cuda" else None


INTEGRATION = Integration(
    name="megatron",
    reason="Megatron's CUDA-only extensions provided or blocked, its fused paths on the plugin's kernels",
    install=_install,
    uninstall=_uninstall,
    framework=MEGATRON_CORE,
    needs=("cuda-redirect",),  # Megatron calls torch.cuda throughout
    triggers=(CORE, JIT, TRAINING),
    patch_sets=(EXTENSION_MODULES.name, "megatron-core", "megatron-core-jit", "megatron-training",
                "megatron-training-flags"),
    applies=_applies,
)
