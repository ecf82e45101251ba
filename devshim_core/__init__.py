"""devshim: run unmodified DeepSpeed and Megatron scripts on whatever accelerator the machine has.

Importing this package changes nothing; ``import devshim_core.auto`` (or :func:`activate`) activates devshim.
Users ask what it did with :func:`active_session`; plugin authors need :data:`hookimpl` and the records below.
The names are loaded on first use, so that importing a devshim module (the ``DEVSHIM_AUTO`` start-up hook runs in
every Python process) costs no more than that module.
"""

from __future__ import annotations

# neither typing nor importlib at import time: the DEVSHIM_AUTO start-up hook imports this package in every Python
# process of the environment, most of which never import torch
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from devshim_core.api import SessionInfo, activate, active_session
    from devshim_core.hookspecs import hookimpl
    from devshim_core.records import (
        AllocatorSpec,
        AttentionKernels,
        CollectivesSpec,
        DeviceReport,
        DeviceTraits,
        EnvironmentMap,
        FusedKernels,
        OffloadIO,
        OptimizerKernels,
    )

__version__ = "0.1.0"

_EXPORTS = {
    "SessionInfo": "devshim_core.api",
    "activate": "devshim_core.api",
    "active_session": "devshim_core.api",
    "hookimpl": "devshim_core.hookspecs",
    "AllocatorSpec": "devshim_core.records",
    "AttentionKernels": "devshim_core.records",
    "FusedKernels": "devshim_core.records",
    "CollectivesSpec": "devshim_core.records",
    "DeviceReport": "devshim_core.records",
    "DeviceTraits": "devshim_core.records",
    "EnvironmentMap": "devshim_core.records",
    "OffloadIO": "devshim_core.records",
    "OptimizerKernels": "devshim_core.records",
}

__all__ = [
    "AllocatorSpec",
    "AttentionKernels",
    "CollectivesSpec",
    "DeviceReport",
    "DeviceTraits",
    "EnvironmentMap",
    "FusedKernels",
    "OffloadIO",
    "OptimizerKernels",
    "SessionInfo",
    "__version__",
    "activate",
    "active_session",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'devshim_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
