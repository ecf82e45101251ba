"""Install the DeepSpeed patch set now, or the moment DeepSpeed's accelerator module is imported."""

from __future__ import annotations

import os

from devshim_core import import_hooks
from devshim_core.device import Device
from devshim_core.errors import PatchError
from devshim_core.integrations.deepspeed.patches import (
    ACCELERATOR_MODULE,
    COMPRESSED_BACKEND_MODULE,
    COMPRESSED_BACKEND_PATCHES,
    DEEPSPEED,
    DEEPSPEED_PATCHES,
    GATHER_ORDER_PATCHES,
    OPTIMIZER_PATCHES,
    OPTIMIZERS_MODULE,
    PARAMETERS_MODULE,
)
from devshim_core.patching import REGISTRY


def _overridden_selection() -> str:
    chosen = os.environ.get("DS_ACCELERATOR")
    return f"; DS_ACCELERATOR={chosen} is ignored (devshim's accelerator is used)" if chosen else ""


def install(device: Device) -> str:
    """Apply (or arm) the DeepSpeed patches; return a one-line status for reports."""
    problem = DEEPSPEED.problem()
    if problem is not None:
        raise PatchError(f"devshim's DeepSpeed integration cannot run: {problem}. Install a supported DeepSpeed "
                         f"(pip install 'deepspeed{DEEPSPEED.spec}'), or set DEVSHIM_PATCH_DEEPSPEED=0 to run "
                         "without it.")
    note = _overridden_selection()
    if not REGISTRY.is_applied(OPTIMIZER_PATCHES.name):
        import_hooks.after_import(OPTIMIZERS_MODULE, lambda module: REGISTRY.apply(OPTIMIZER_PATCHES, device))
    if not REGISTRY.is_applied(COMPRESSED_BACKEND_PATCHES.name):  # imported only by the 1-bit optimizers
        import_hooks.after_import(COMPRESSED_BACKEND_MODULE,
                                  lambda module: REGISTRY.apply(COMPRESSED_BACKEND_PATCHES, device))
    # only for the releases that wait for one handle of a coalesced gather (0.19.8 waits for all)
    if not REGISTRY.is_applied(GATHER_ORDER_PATCHES.name) and not REGISTRY.check(GATHER_ORDER_PATCHES):
        import_hooks.after_import(PARAMETERS_MODULE, lambda module: REGISTRY.apply(GATHER_ORDER_PATCHES, device))
    if REGISTRY.is_applied(DEEPSPEED_PATCHES.name):
        return "applied" + note
    if import_hooks.is_imported(ACCELERATOR_MODULE):
        REGISTRY.apply(DEEPSPEED_PATCHES, device)
        return "applied (deepspeed was imported first: import-time references were rebound)" + note
    import_hooks.after_import(ACCELERATOR_MODULE, lambda module: REGISTRY.apply(DEEPSPEED_PATCHES, device))
    return "armed: applied when deepspeed is imported, before its op builders are bound" + note


def uninstall() -> None:
    import_hooks.cancel(ACCELERATOR_MODULE)
    import_hooks.cancel(OPTIMIZERS_MODULE)
    import_hooks.cancel(COMPRESSED_BACKEND_MODULE)
    import_hooks.cancel(PARAMETERS_MODULE)
    REGISTRY.revert(GATHER_ORDER_PATCHES.name)
    REGISTRY.revert(COMPRESSED_BACKEND_PATCHES.name)
    REGISTRY.revert(OPTIMIZER_PATCHES.name)
    REGISTRY.revert(DEEPSPEED_PATCHES.name)
