"""Install the DeepSpeed patch set now, or the moment DeepSpeed's accelerator module is imported."""

from __future__ import annotations

import os

from devshim_core import import_hooks
from devshim_core.device import Device
from devshim_core.errors import PatchError
from devshim_core.integrations.base import Status
from devshim_core.integrations.deepspeed.patches import (
    ACCELERATOR_MODULE,
    COMPRESSED_BACKEND_MODULE,
    COMPRESSED_BACKEND_PATCHES,
    DEEPSPEED,
    DEEPSPEED_PATCHES,
    GATHER_ORDER_PATCHES,
    ONE_PASS_OFFLOAD_PATCHES,
    OPTIMIZER_PATCHES,
    OPTIMIZERS_MODULE,
    PARAMETERS_MODULE,
    STAGE_1_AND_2_MODULE,
)
from devshim_core.patching import REGISTRY

# sets applied when their module is imported; each only for the DeepSpeed releases it declares
_WHEN_IMPORTED = (
    (OPTIMIZER_PATCHES, OPTIMIZERS_MODULE),
    (COMPRESSED_BACKEND_PATCHES, COMPRESSED_BACKEND_MODULE),  # imported only by the 1-bit optimizers
    (GATHER_ORDER_PATCHES, PARAMETERS_MODULE),
    (ONE_PASS_OFFLOAD_PATCHES, STAGE_1_AND_2_MODULE),
)


def _overridden_selection() -> str:
    chosen = os.environ.get("DS_ACCELERATOR")
    return f"; DS_ACCELERATOR={chosen} is ignored (devshim's accelerator is used)" if chosen else ""


def install(device: Device, status: Status) -> None:
    """Apply (or arm) the DeepSpeed patches, reporting through ``status``."""
    status.set(_install(device, status))


def _install(device: Device, status: Status) -> str:
    problem = DEEPSPEED.problem()
    if problem is not None:
        raise PatchError(f"devshim's DeepSpeed integration cannot run: {problem}. Install a supported DeepSpeed "
                         f"(pip install 'deepspeed{DEEPSPEED.spec}'), or set DEVSHIM_PATCH_DEEPSPEED=0 to run "
                         "without it.")
    note = _overridden_selection()
    for patch_set, module in _WHEN_IMPORTED:
        REGISTRY.apply_when_imported(patch_set, module, device)
    if REGISTRY.is_applied(DEEPSPEED_PATCHES.name):
        return "applied" + note
    if import_hooks.is_imported(ACCELERATOR_MODULE):
        REGISTRY.apply(DEEPSPEED_PATCHES, device)
        return "applied (deepspeed was imported first: import-time references were rebound)" + note

    def apply_and_report(module: object) -> None:
        REGISTRY.apply(DEEPSPEED_PATCHES, device)
        status.fired()

    import_hooks.after_import(ACCELERATOR_MODULE, apply_and_report)
    return "armed: applied when deepspeed is imported, before its op builders are bound" + note


def uninstall() -> None:
    import_hooks.cancel(ACCELERATOR_MODULE)
    for patch_set, module in reversed(_WHEN_IMPORTED):
        import_hooks.cancel(module)
        REGISTRY.revert(patch_set.name)
    REGISTRY.revert(DEEPSPEED_PATCHES.name)
