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
from devshim_core.integrations.torch_distributed import TORCH, in_both_modules
from devshim_core.patching import PatchSet


def _with_plugin_kwargs(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    spec = device.collectives

    @functools.wraps(original)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if backend is None or str(backend).lower() == spec.backend:
            for key, value in spec.init_kwargs.items():
                kwargs.setdefault(key, value)
        return original(backend, *args, **kwargs)

    init_process_group.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return init_process_group


def patch_set(device: Device) -> PatchSet:
    return PatchSet(
        name="torch.distributed",
        requires=(TORCH,),
        reason=f"pass the {device.plugin} plugin's init_process_group arguments "
               f"({', '.join(device.collectives.init_kwargs)}) to the {device.collectives.backend} backend",
        patches=in_both_modules("init_process_group", "init_process_group", _with_plugin_kwargs,
                                "the backend needs options frameworks do not pass"),
    )
