"""What devshim changes in ``torch.distributed`` for every job, and the plugin's own process-group arguments.

- ``clean_exit``: gloo's worker threads settle before the interpreter finalizes (no abort after success);
- ``shared_memory``: CPU collectives between ranks of one host go through shared memory, not TCP, the ranks
  comparing their calls first;
- ``timeouts``: a collective that times out names itself and how to set the timeout;
- ``agreement``: every rank runs on rank 0's plugin and collectives switch, or ``init_process_group`` says which
  rank differs (or lacks devshim);
- ``plugin_kwargs``: the plugin's extra ``init_process_group`` arguments, when it has any.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.patching import PatchSet, Requirement, SetAttribute

TORCH = Requirement("torch", ">=2.4,<3")  # the torch releases every set of this package was written for
REEXPORT_REASON = "torch.distributed re-exports the function; callers use that name"


def in_both_modules(name: str, function: str, make: Callable[[Any, Device], Any],
                    reason: str) -> tuple[SetAttribute, SetAttribute]:
    """``function`` patched where it is defined (``distributed_c10d``) and where callers find it (the package)."""
    return (SetAttribute(name=name, target=f"torch.distributed.distributed_c10d:{function}", make=make,
                         reason=reason),
            SetAttribute(name=f"{name}-reexport", target=f"torch.distributed:{function}", make=make,
                         reason=REEXPORT_REASON))


def job_patch_sets(device: Device, job_level: bool = True,
                   shared_memory_collectives: bool = True) -> list[tuple[PatchSet, str]]:
    """The sets to apply for ``device``, in order, each with the one-line summary ``devshim info`` shows.

    ``job_level=False`` (``DEVSHIM_PATCH_DISTRIBUTED=0``) leaves out all but the plugin's own arguments, which
    its backend needs to work at all. ``shared_memory_collectives=False``
    (``DEVSHIM_SHARED_MEMORY_COLLECTIVES=0``) leaves gloo's own transport for every collective.
    """
    from devshim_core.integrations.torch_distributed import (
        agreement,
        clean_exit,
        plugin_kwargs,
        shared_memory,
        timeouts,
    )

    sets = [(clean_exit.patch_set(device), "gloo workers settle before finalization")] if job_level else []
    # before the timeouts, which then name the caller's collective when a barrier inside these times out
    if job_level and shared_memory_collectives:
        sets.append((shared_memory.patch_set(device), "CPU collectives on one host through shared memory"))
    if job_level:
        sets += [(timeouts.patch_set(device), f"{len(timeouts.COLLECTIVES)} collectives name their timeouts"),
                 (agreement.patch_set(device, shared_memory_collectives),
                  "ranks check they share rank 0's plugin and collectives switch")]
    if device.collectives.init_kwargs:  # outermost: the arguments are added before anything else runs
        sets.append((plugin_kwargs.patch_set(device), ", ".join(device.collectives.init_kwargs)))
    return sets
