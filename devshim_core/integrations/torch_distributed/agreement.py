"""Every rank of a job runs devshim alike, or the job stops at ``init_process_group`` saying which rank differs.

Each process selects its plugin on its own, from what its node has installed and its environment. A node with
another plugin installed, or a variable the launcher did not forward, would otherwise train on a mix of devices
and backends; a rank with the shared-memory collectives off while the others have them on would wait in gloo
while they wait in shared memory. Right after the process group exists, rank 0 publishes its plugin, device type
and collectives switch in the group's store, and every other rank compares its own with them: one store read per
rank, whatever the world size.

A rank without devshim (or with ``DEVSHIM_PATCH_DISTRIBUTED=0``) publishes nothing. The others then wait at most
``WAIT_S`` (or the group's timeout, if shorter) and say so: rank 0 counts the ranks that reported, and the other
ranks wait for rank 0's entry, instead of failing at the store's timeout with a bare ``DistStoreError``.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.errors import ConfigError
from devshim_core.integrations.torch_distributed import TORCH, in_both_modules
from devshim_core.patching import PatchSet

STORE_PREFIX = "devshim/selection"
WAIT_S = 30.0  # ranks return from init_process_group together: a rank missing after this never reports
_POLL_S = 0.01
_generation = itertools.count()  # each init_process_group of this process: the ranks re-initialise in step


class PluginMismatchError(ConfigError):
    """Ranks of one job selected different plugins, or set devshim's collectives differently, or one lacks devshim."""


def selection_of(device: Device, shared_memory: bool = True) -> dict[str, Any]:
    return {"plugin": device.plugin, "device": device.type, "shared_memory_collectives": shared_memory}


_WITHOUT = ("runs without devshim (no `import devshim_core.auto` and no DEVSHIM_AUTO=1 in its environment) or with "
            "DEVSHIM_PATCH_DISTRIBUTED=0; start every rank the same way")


def _difference(rank: int, mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    if (mine["plugin"], mine["device"]) != (theirs["plugin"], theirs["device"]):
        return (f"rank {rank} selected the {mine['plugin']} plugin ({mine['device']} devices), but rank 0 selected "
                f"{theirs['plugin']} ({theirs['device']} devices): every rank of a job must use the same devshim "
                "plugin. Install the same devshim plugins on every node, or set DEVSHIM_PLUGIN on every rank (the "
                "deepspeed launcher forwards DEVSHIM_* variables to other nodes; torchrun and mpirun do not). "
                "`devshim info` on each node says what it selects and why.")
    if mine["shared_memory_collectives"] != theirs["shared_memory_collectives"]:
        value = {True: "1 (the default)", False: "0"}
        return (f"rank {rank} has DEVSHIM_SHARED_MEMORY_COLLECTIVES={value[mine['shared_memory_collectives']]}, "
                f"but rank 0 has {value[theirs['shared_memory_collectives']]}: the ranks would wait for each other on "
                "different transports. Set it alike on every rank (torchrun and mpirun do not forward it to other "
                "nodes).")
    return None


def _wait_s() -> float:
    import torch.distributed as dist

    from devshim_core.integrations.torch_distributed.shm_segment import group_timeout_s

    return min(WAIT_S, group_timeout_s(dist.distributed_c10d._get_default_group()))


def check_same_plugin(device: Device, shared_memory: bool = True) -> None:
    """Compare this rank's selection with rank 0's, through the default group's store."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    prefix = f"{STORE_PREFIX}/{next(_generation)}"
    rank, size, mine = dist.get_rank(), dist.get_world_size(), selection_of(device, shared_memory)
    store.set(f"{prefix}/rank{rank}", "1")
    store.add(f"{prefix}/reported", 1)
    wait_s = _wait_s()
    if rank == 0:
        store.set(f"{prefix}/rank0-selection", json.dumps(mine))
        deadline = time.monotonic() + wait_s
        while store.add(f"{prefix}/reported", 0) < size:
            if time.monotonic() >= deadline:
                missing = [k for k in range(size) if not store.check([f"{prefix}/rank{k}"])]
                names = ", ".join(map(str, missing))
                raise PluginMismatchError(
                    f"rank{'s' if len(missing) > 1 else ''} {names} did not report devshim's selection to rank 0 "
                    f"within {wait_s:.0f} s of init_process_group: such a rank {_WITHOUT}.")
            time.sleep(_POLL_S)
        return
    try:
        store.wait([f"{prefix}/rank0-selection"], datetime.timedelta(seconds=wait_s))
    except RuntimeError as exc:  # DistStoreError: rank 0 never published
        raise PluginMismatchError(
            f"rank {rank} waited {wait_s:.0f} s after init_process_group for rank 0's devshim selection, which never "
            f"came: rank 0 {_WITHOUT}.") from exc
    theirs = json.loads(store.get(f"{prefix}/rank0-selection").decode())
    difference = _difference(rank, mine, theirs)
    if difference is not None:
        raise PluginMismatchError(difference)


def _checked(device: Device, shared_memory: bool) -> Callable[[Any, Device], Any]:
    def make(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            check_same_plugin(device, shared_memory)
            return result

        init_process_group.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
        return init_process_group

    return make


def patch_set(device: Device, shared_memory: bool = True) -> PatchSet:
    return PatchSet(
        name="torch.distributed-agreement",
        requires=(TORCH,),
        reason="every rank of a job must run devshim alike; a rank that differs or lacks devshim stops "
               "init_process_group, named",
        patches=in_both_modules("init_process_group-agreement", "init_process_group", _checked(device, shared_memory),
                                "compare the plugin and the collectives switch with rank 0's once the group's store "
                                "exists"),
    )
