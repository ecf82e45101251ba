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
    NO_JIT_PATCHES,
    ONE_PASS_OFFLOAD_PATCHES,
    OP_BUILDER_MODULE,
    OPTIMIZER_PATCHES,
    OPTIMIZERS_MODULE,
    PARAMETERS_MODULE,
    STAGE_1_AND_2_MODULE,
    installed_metadata_version,
    running_deepspeed,
    running_deepspeed_directory,
)
from devshim_core.patching import REGISTRY, version_in_range

# sets applied when their module is imported; each only for the DeepSpeed releases it declares
_WHEN_IMPORTED = (
    (NO_JIT_PATCHES, OP_BUILDER_MODULE),
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


def _refusal() -> PatchError | None:
    """Why the DeepSpeed that runs cannot be patched, judged by its code's own version, or ``None``."""
    problem = DEEPSPEED.problem()
    if problem is None:
        return None
    running, metadata = running_deepspeed(), installed_metadata_version()
    if running is not None and metadata is not None and running != metadata:
        where = running_deepspeed_directory()
        fix = (f"Take {where.parent if where else 'that package'} off sys.path/PYTHONPATH (the installed deepspeed "
               f"{metadata} then runs)" if version_in_range(metadata, DEEPSPEED.spec) else
               f"Install a supported DeepSpeed (pip install 'deepspeed{DEEPSPEED.spec}') in its place")
        return PatchError(f"devshim's DeepSpeed integration cannot run: the deepspeed package that runs, {where}, is "
                          f"deepspeed {running} (its own code says so; the installed distribution's metadata says "
                          f"{metadata}, and the code wins), and devshim supports deepspeed{DEEPSPEED.spec}. {fix}, or "
                          "set DEVSHIM_PATCH_DEEPSPEED=0 to run without devshim's DeepSpeed integration.")
    return PatchError(f"devshim's DeepSpeed integration cannot run: {problem}. Install a supported DeepSpeed "
                      f"(pip install 'deepspeed{DEEPSPEED.spec}'), or set DEVSHIM_PATCH_DEEPSPEED=0 to run "
                      "without it.")


def _install(device: Device, status: Status) -> str:
    refusal = _refusal()
    if refusal is not None:
        raise refusal
    note = _overridden_selection()
    for patch_set, module in _WHEN_IMPORTED:
        REGISTRY.apply_when_imported(patch_set, module, device)
    if REGISTRY.is_applied(DEEPSPEED_PATCHES.name):
        return "applied" + note
    if import_hooks.is_imported(ACCELERATOR_MODULE):
        REGISTRY.apply(DEEPSPEED_PATCHES, device)
        return "applied (deepspeed was imported first: import-time references were rebound)" + note

    def apply_and_report(module: object) -> None:
        # checked again now that deepspeed's own code is importing: the package sys.path gave it may not be the
        # one checked at activation, and the import fails here rather than run code devshim was not written for
        refusal = _refusal()
        if refusal is not None:
            raise refusal
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
