"""Which Megatron was imported: megatron-core (installed, or Megatron-LM's checkout) or a fork of it.

Megatron-DeepSpeed ships its own ``megatron/core`` (its ``package_info`` says 0.2.0), older and different;
megatron-core 0.16 patches must never touch it. Its tell: ``megatron/training.py`` is a module beside
``megatron/core``, where Megatron-LM has a ``megatron/training/`` package.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from devshim_core.patching import Requirement


@dataclass(frozen=True)
class ImportedMegatronCore(Requirement):
    """The version of the ``megatron.core`` that is *imported* (its ``package_info``), not of the installed
    distribution: Megatron-LM's checkout on ``PYTHONPATH`` shadows the wheel."""

    distribution: str = "megatron-core"
    # tested at 0.12.1 (MindSpeed's current releases pair with it) and 0.16.1 (docs/versions.md)
    spec: str = ">=0.12.1,<0.17"

    def installed(self) -> str | None:
        info = sys.modules.get("megatron.core.package_info")
        if info is None:
            try:
                from megatron.core import package_info as info  # type: ignore[no-redef]  # info again: the module, now imported
            except ImportError:
                return None
        return getattr(info, "__version__", None)


MEGATRON_CORE = ImportedMegatronCore()
# gates of patches for one release line's own bugs (the patch is left out, reported, on the others)
CORE_0_12 = ImportedMegatronCore(spec=">=0.12.1,<0.13", gate=True)
CORE_0_16 = ImportedMegatronCore(spec=">=0.16,<0.17", gate=True)


def is_megatron_deepspeed() -> bool:
    """Megatron-DeepSpeed's fork: its ``megatron.core`` sits beside a ``training.py`` module."""
    core = sys.modules.get("megatron.core")
    core_file = getattr(core, "__file__", None)
    if not core_file:
        return False
    package_dir = os.path.dirname(os.path.dirname(core_file))
    return os.path.isfile(os.path.join(package_dir, "training.py"))


def is_megatron_core() -> bool:
    """Whether the imported ``megatron.core`` is megatron-core (any version), not Megatron-DeepSpeed's fork."""
    return "megatron.core" in sys.modules and not is_megatron_deepspeed()
