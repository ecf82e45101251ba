"""The ``torch.distributed`` integration's record: the job-level sets, and the plugin's own process-group arguments."""

from __future__ import annotations

from devshim_core.device import Device
from devshim_core.integrations.base import Integration, Status
from devshim_core.integrations.torch_distributed import TORCH, job_patch_sets
from devshim_core.patching import REGISTRY
from devshim_core.settings import Settings


def _install(device: Device, settings: Settings, status: Status) -> None:
    # each set reports under its own name (several lines of devshim info), the switches' effect under theirs
    if not settings.patch_distributed:
        status.child("distributed").set("skipped: DEVSHIM_PATCH_DISTRIBUTED=0")
    elif not settings.shared_memory_collectives:
        status.child("torch.distributed-shared-memory").set("skipped: DEVSHIM_SHARED_MEMORY_COLLECTIVES=0")
    for patch_set, summary in job_patch_sets(device, job_level=settings.patch_distributed,
                                             shared_memory_collectives=settings.shared_memory_collectives):
        applied = REGISTRY.apply(patch_set, device)
        status.child(patch_set.name).set(f"applied ({summary})" if applied.disabled is None
                                         else f"skipped: {applied.disabled}")


INTEGRATION = Integration(
    name="torch.distributed",
    reason="clean exits, shared-memory collectives, named timeouts, plugin agreement, the plugin's init arguments",
    install=_install,
    uninstall=lambda: None,  # the registry reverts its sets
    framework=TORCH,
    patch_sets=("torch.distributed-exit", "torch.distributed-shared-memory", "torch.distributed-timeouts",
                "torch.distributed-agreement", "torch.distributed"),
)
