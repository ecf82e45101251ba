"""The DeepSpeed integration's record: applied now, or armed for the moment DeepSpeed's accelerator is imported."""

from __future__ import annotations

import importlib.util

from devshim_core.device import Device
from devshim_core.distributions import installed_version
from devshim_core.integrations.base import Integration, Status
from devshim_core.integrations.deepspeed.patches import (
    ACCELERATOR_MODULE,
    COMPRESSED_BACKEND_PATCHES,
    DEEPSPEED,
    DEEPSPEED_PATCHES,
    GATHER_ORDER_PATCHES,
    NO_JIT_PATCHES,
    ONE_PASS_OFFLOAD_PATCHES,
    OPTIMIZER_PATCHES,
)
from devshim_core.settings import Settings


def _install(device: Device, settings: Settings, status: Status) -> None:
    from devshim_core.integrations.deepspeed.install import install

    install(device, status)


def _uninstall() -> None:
    from devshim_core.integrations.deepspeed.install import uninstall

    uninstall()


def _applies(device: Device, settings: Settings) -> str | None:
    if installed_version("deepspeed") is None or importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    return None


INTEGRATION = Integration(
    name="deepspeed",
    reason="devshim's accelerator for DeepSpeed, op builders on the plugin's kernels, ZeRO-Offload's one-pass Adam",
    install=_install,
    uninstall=_uninstall,
    framework=DEEPSPEED,
    triggers=(ACCELERATOR_MODULE,),
    patch_sets=tuple(s.name for s in (DEEPSPEED_PATCHES, NO_JIT_PATCHES, OPTIMIZER_PATCHES, COMPRESSED_BACKEND_PATCHES,
                                      GATHER_ORDER_PATCHES, ONE_PASS_OFFLOAD_PATCHES)),
    applies=_applies,
)
