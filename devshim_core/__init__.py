"""devshim: run unmodified DeepSpeed and Megatron scripts on whatever accelerator the machine has.

Importing this package changes nothing; ``import devshim_core.auto`` activates devshim.
Plugin authors need :data:`hookimpl` and the records below.
"""

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
    "__version__",
    "hookimpl",
]
