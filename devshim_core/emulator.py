"""devshim's emulator, when one is installed: found through the ``devshim.emulation`` entry-point group.

The emulated vendor devices (``DEVSHIM_EMULATE=ascend|sophgo``) are a distribution of their own, devshim-emulation,
which registers ``emulator = "devshim_emulation.hooks"``. The core never imports it by name: it asks the object that
entry point names for three things, and this module is where it asks.

- ``requested_vendor(environ) -> str | None``: the vendor ``DEVSHIM_EMULATE`` names (``None`` when off); a name no
  vendor has is a :class:`~devshim_core.errors.ConfigError` the emulator raises;
- ``bring_up(vendor) -> None``: the vendor's simulated SDK installed and imported, its device up, before the
  plugins look for it;
- ``cache_state() -> dict``: where the emulator is built and whether it is (``built``, ``building``, ``missing``),
  for ``devshim info``, without building anything.

Without an installed emulator ``DEVSHIM_EMULATE`` is a ``ConfigError`` saying what to install, and
:func:`cache_state` says ``not installed``. Nothing here runs unless ``DEVSHIM_EMULATE`` is set or ``devshim info``
reports the host.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

from devshim_core.errors import ConfigError

GROUP = "devshim.emulation"
NAME = "emulator"
EMULATE_ENV = "DEVSHIM_EMULATE"
DISTRIBUTION = "devshim-emulation"
_OFF = ("", "0", "off", "false", "no")  # DEVSHIM_EMULATE values that turn emulation off

_loaded: list[Any] = []  # the emulator, once loaded ([None]: none is installed)


def _entry_point() -> importlib.metadata.EntryPoint | None:
    found = sorted(importlib.metadata.entry_points(group=GROUP), key=lambda ep: (ep.name != NAME, ep.value))
    return found[0] if found else None


def emulator() -> Any | None:
    """The installed emulator (what the ``devshim.emulation`` entry point names), or ``None`` without one; an
    emulator that fails to load is a ``ConfigError`` naming it."""
    if not _loaded:
        entry_point = _entry_point()
        if entry_point is None:
            return None  # not cached: installing it later in this process (a test) is seen
        try:
            _loaded.append(entry_point.load())
        except Exception as exc:
            where = f" from {entry_point.dist.name} {entry_point.dist.version}" if entry_point.dist else ""
            raise ConfigError(f"devshim's emulator ({GROUP} entry point {entry_point.name} = {entry_point.value}"
                              f"{where}) failed to load: {type(exc).__name__}: {exc}. Reinstall it "
                              f"(pip install ./emulation) or unset {EMULATE_ENV}.") from exc
    return _loaded[0]


def _not_installed(value: str) -> ConfigError:
    return ConfigError(f"{EMULATE_ENV}={value} needs devshim's emulator: pip install ./emulation ({DISTRIBUTION})")


def requested_vendor(environ: Mapping[str, str]) -> str | None:
    """The vendor ``DEVSHIM_EMULATE`` names in ``environ``, or ``None`` when emulation is off."""
    raw = environ.get(EMULATE_ENV, "").strip()
    if not raw:
        return None
    found = emulator()
    if found is None:
        if raw.lower() in _OFF:
            return None
        raise _not_installed(raw)
    return found.requested_vendor(environ)


def bring_up(vendor: str) -> None:
    """Bring ``vendor``'s emulated device up (its simulated SDK installed and imported) in this process."""
    found = emulator()
    if found is None:
        raise _not_installed(vendor)
    found.bring_up(vendor)


def cache_state() -> dict[str, Any]:
    """Where the emulator is built and whether it is: ``state`` built/building/missing with ``cache_root``,
    ``directory`` and ``library``; ``not installed`` without an emulator; ``unknown`` with an ``error`` when asking
    failed (a report never fails for it)."""
    facts: dict[str, Any] = {"state": "not installed", "cache_root": None, "directory": None, "library": None}
    try:
        found = emulator()
        if found is None:
            return facts
        return dict(found.cache_state())
    except Exception as exc:
        facts.update(state="unknown", error=f"{type(exc).__name__}: {exc}")
        return facts
