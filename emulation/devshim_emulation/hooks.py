"""What devshim-core asks of its emulator, registered under the ``devshim.emulation`` entry-point group as
``emulator`` (devshim-core's :mod:`devshim_core.emulator` loads it; devshim-core never imports this distribution
by name).

- :func:`requested_vendor`: the vendor ``DEVSHIM_EMULATE`` names in ``environ``, ``None`` when off; a name no
  vendor has is an :class:`~devshim_emulation.errors.EmulationError` (a ``ConfigError``);
- :func:`bring_up`: the vendor's simulated SDK installed and imported, its emulated device up (built on a machine's
  first use), before devshim's plugins look for it;
- :func:`cache_state`: where the emulator is built and whether it is, for ``devshim info``, without building,
  importing or waiting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def requested_vendor(environ: Mapping[str, str]) -> str | None:
    from devshim_emulation.sdks import requested_vendor

    return requested_vendor(environ)


def bring_up(vendor: str) -> None:
    from devshim_emulation.sdks import bring_up

    bring_up(vendor)


def cache_state() -> dict[str, Any]:
    """``{"cache_root", "state", "directory", "library"}``: state ``built`` (the library is there), ``building``
    (another process holds the build lock) or ``missing`` (the first ``DEVSHIM_EMULATE`` run builds it)."""
    from devshim_emulation import build

    facts: dict[str, Any] = {"cache_root": str(build.cache_root())}
    try:
        state, directory, library = build.build_state()
    except Exception as exc:  # e.g. an unreadable source: report it, never fail the report
        facts.update(state="unknown", directory=None, library=None, error=f"{type(exc).__name__}: {exc}")
        return facts
    facts.update(state=state, directory=str(directory), library=str(library) if library else None)
    return facts
