"""The plugin's extra ``init_process_group`` arguments (``CollectivesSpec.init_kwargs``), handed to torch.

Vendor backends take options that frameworks never pass (Sophgo's ``pg_options`` with the chip map):
``init_process_group`` calls that choose the plugin's backend, or none, get them as defaults; arguments
the caller gives win.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.patching import PatchSet, Requirement, SetAttribute

TORCH = Requirement("torch", ">=2.4,<3")


def _with_plugin_kwargs(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    spec = device.collectives

    @functools.wraps(original)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if backend is None or str(backend).lower() == spec.backend:
            for key, value in spec.init_kwargs.items():
                kwargs.setdefault(key, value)
        return original(backend, *args, **kwargs)

    init_process_group.__devshim_original__ = original  # type: ignore[attr-defined]
    return init_process_group


def patch_set(device: Device) -> PatchSet:
    make = _with_plugin_kwargs
    return PatchSet(
        name="torch.distributed",
        requires=(TORCH,),
        reason=f"pass the {device.plugin} plugin's init_process_group arguments "
               f"({', '.join(device.collectives.init_kwargs)}) to the {device.collectives.backend} backend",
        patches=(
            SetAttribute(name="init_process_group", target="torch.distributed.distributed_c10d:init_process_group",
                         make=make, reason="the backend needs options frameworks do not pass"),
            SetAttribute(name="init_process_group-reexport", target="torch.distributed:init_process_group",
                         make=make, reason="torch.distributed re-exports the function; callers use that name"),
        ),
    )
