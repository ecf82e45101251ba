"""Every rank of a job runs on the same plugin, or the job stops at ``init_process_group`` saying which rank differs.

Each process selects its plugin on its own, from what its node has installed and its environment. A node with
another plugin installed, or a variable the launcher did not forward, would otherwise train on a mix of
devices and backends. Right after the process group exists, rank 0 publishes its plugin and device type in
the group's store, and every other rank compares its own with it: one store read per rank, whatever the world
size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.errors import ConfigError
from devshim_core.integrations.torch_distributed import TORCH, in_both_modules
from devshim_core.patching import PatchSet

STORE_KEY = "devshim/selection/rank0"


class PluginMismatchError(ConfigError):
    """Ranks of one job selected different plugins."""


def selection_of(device: Device) -> str:
    return f"{device.plugin}:{device.type}"


def check_same_plugin(device: Device) -> None:
    """Compare this rank's plugin and device type with rank 0's, through the default group's store."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank, mine = dist.get_rank(), selection_of(device)
    if rank == 0:
        store.set(STORE_KEY, mine)
        return
    theirs = store.get(STORE_KEY).decode()
    if theirs != mine:
        plugin, device_type = theirs.split(":", 1)
        raise PluginMismatchError(
            f"rank {rank} selected the {device.plugin} plugin ({device.type} devices), but rank 0 selected "
            f"{plugin} ({device_type} devices): every rank of a job must use the same devshim plugin. Install the "
            "same devshim plugins on every node, or set DEVSHIM_PLUGIN on every rank (the deepspeed launcher "
            "forwards DEVSHIM_* variables to other nodes; torchrun and mpirun do not). `devshim info` on each "
            "node says what it selects and why.")


def _checked(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        check_same_plugin(device)
        return result

    init_process_group.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return init_process_group


def patch_set(device: Device) -> PatchSet:
    return PatchSet(
        name="torch.distributed-agreement",
        requires=(TORCH,),
        reason="every rank of a job must run on the same plugin; a mismatch stops init_process_group naming the rank",
        patches=in_both_modules("init_process_group-agreement", "init_process_group", _checked,
                                "compare the plugin with rank 0's once the group's store exists"),
    )
