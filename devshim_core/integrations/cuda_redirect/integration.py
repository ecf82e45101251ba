"""The CUDA redirect's record: on wherever the selected device is not CUDA."""

from __future__ import annotations

from devshim_core.device import Device
from devshim_core.integrations.base import Integration, Status
from devshim_core.patching import REGISTRY, Requirement
from devshim_core.settings import Settings

NAME = "cuda-redirect"


def _install(device: Device, settings: Settings, status: Status) -> None:
    from devshim_core.integrations.cuda_redirect.patches import patch_set

    applied = REGISTRY.apply(patch_set(device), device)
    status.set(f"applied ({applied.patch_set.reason})" if applied.disabled is None else f"skipped: {applied.disabled}")


def _applies(device: Device, settings: Settings) -> str | None:
    return "the selected device is CUDA" if device.type == "cuda" else None


INTEGRATION = Integration(
    name=NAME,
    reason="torch.cuda.*, 'cuda' devices, CUDA type names, CUDA autocast and nccl answered by the selected device",
    install=_install,
    uninstall=lambda: None,  # the registry reverts its set
    framework=Requirement("torch", ">=2.4,<3"),
    patch_sets=(NAME,),
    applies=_applies,
)
