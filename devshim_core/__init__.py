"""devshim: run unmodified DeepSpeed and Megatron scripts on whatever accelerator the machine has.

Importing this package changes nothing; ``import devshim_core.auto`` (or :func:`activate`) activates devshim.
Users ask what it did with :func:`active_session`; plugin authors need :data:`hookimpl` and the records below.
"""

from devshim_core.api import SessionInfo, activate, active_session
from devshim_core.hookspecs import hookimpl
from devshim_core.records import (
    AllocatorSpec,
    AttentionKernels,
    CollectivesSpec,
    DeviceReport,
    DeviceTraits,
    OffloadIO,
    OptimizerKernels,
)

__version__ = "0.1.0"

__all__ = [
    "AllocatorSpec",
    "AttentionKernels",
    "CollectivesSpec",
    "DeviceReport",
    "DeviceTraits",
    "OffloadIO",
    "OptimizerKernels",
    "SessionInfo",
    "__version__",
    "activate",
    "active_session",
    "hookimpl",
]
