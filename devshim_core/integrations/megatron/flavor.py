"""Which Megatron was imported: megatron-core (installed, or Megatron-LM's checkout) or a fork of it.

Megatron-DeepSpeed ships its own ``megatron/core``, older and different; megatron-core 0.16 patches must never
touch it. megatron-core has ``megatron.core.package_info``; the fork does not.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from devshim_core.patching import Requirement


@dataclass(frozen=True)
class ImportedMegatronCore(Requirement):
    """The version of the ``megatron.core`` that is *imported* (its ``package_info``), not of the installed
    distribution: Megatron-LM's checkout on ``PYTHONPATH`` shadows the wheel."""

    distribution: str = "megatron-core"
    spec: str = ">=0.16,<0.17"

    def installed(self) -> str | None:
        info = sys.modules.get("megatron.core.package_info")
        if info is None:
            try:
                from megatron.core import package_info as info  # type: ignore[no-redef]
            except ImportError:
                return None
        return getattr(info, "__version__", None)


MEGATRON_CORE = ImportedMegatronCore()


def is_megatron_core() -> bool:
    """Whether the imported ``megatron.core`` is megatron-core (any version), not Megatron-DeepSpeed's fork."""
    return MEGATRON_CORE.installed() is not None


def is_megatron_deepspeed() -> bool:
    """Megatron-DeepSpeed: a ``megatron.core`` without ``package_info``, beside its DeepSpeed-aware training."""
    core = sys.modules.get("megatron.core")
    return core is not None and not is_megatron_core()
