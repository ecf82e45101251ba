"""Which vendor ``DEVSHIM_EMULATE`` asks for, and that vendor's simulated SDK made importable.

Nothing here imports torch: the ``torch.backends`` entry point (:mod:`devshim_emulation.torch_backend`) calls
:func:`install_sdk` from inside ``import torch``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any

from devshim_emulation import vendors

#: vendor -> the device type its SDK registers
VENDORS = vendors.device_types()
SDK_PATH = Path(__file__).with_name("sdk")
EMULATE_ENV = "DEVSHIM_EMULATE"
_OFF = ("", "0", "off", "false", "no")


def requested_vendor(environ: Any = None) -> str | None:
    """The vendor ``DEVSHIM_EMULATE`` names, or ``None`` when emulation is off."""
    env = os.environ if environ is None else environ
    raw = env.get(EMULATE_ENV, "").strip().lower()
    if raw in _OFF:
        return None
    if raw not in VENDORS:
        from devshim_emulation.errors import EmulationError

        raise EmulationError(f"{EMULATE_ENV}={env.get(EMULATE_ENV)!r} names no emulated vendor: use one of "
                             f"{', '.join(sorted(VENDORS))} (or unset it to run on real hardware).")
    return raw


def install_sdk(vendor: str) -> None:
    """Make the simulated SDK of ``vendor`` importable, as if the vendor's packages were installed.

    It only edits ``sys.path`` and the vendor's runtime-location variables; nothing is imported or built.
    """
    if vendor not in VENDORS:
        from devshim_emulation.errors import EmulationError

        raise EmulationError(f"no simulated SDK for {vendor!r}; known: {', '.join(sorted(VENDORS))}")
    spec = vendors.get(vendor)
    if not any(isinstance(f, _SimulatedSdkFinder) and f.package == spec.SDK_PACKAGE for f in sys.meta_path):
        # last on the meta path: a real SDK, if one is installed, still wins
        sys.meta_path.append(_SimulatedSdkFinder(spec.SDK_PACKAGE, spec.SDK_METADATA))
        importlib.invalidate_caches()
    spec.prepare_environment(SDK_PATH)


class _SimulatedSdkFinder(importlib.abc.MetaPathFinder):
    """Serves one vendor's simulated package and its distribution metadata, and nothing else: the other
    vendor's SDK stays invisible, as it would be on a machine of this vendor."""

    def __init__(self, package: str, dist_info: str) -> None:
        self.package = package
        self.distribution = importlib.metadata.PathDistribution(SDK_PATH / dist_info)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.package:
            return None  # its submodules are found through the package's own __path__
        return importlib.machinery.PathFinder.find_spec(fullname, [str(SDK_PATH)])

    def find_distributions(self, context: Any = None) -> Any:
        name = getattr(context, "name", None)
        wanted = self.distribution.metadata["Name"]
        if name is None or name.replace("_", "-").lower() == wanted.lower():
            yield self.distribution


def bring_up(vendor: str) -> Any:
    """Install ``vendor``'s simulated SDK and import it, which brings the emulated device up (building the
    emulator on a machine's first use). A build failure raises here, where it is the user's to fix, instead
    of reading as a broken vendor install in the plugin's detection."""
    install_sdk(vendor)
    return importlib.import_module(vendors.get(vendor).SDK_PACKAGE)
