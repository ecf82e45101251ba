"""The public Python API: which plugin devshim selected, on which device, why, and what it patched.

Stable from 0.1: the names below keep their meaning within a minor series (``docs/versions.md``). They
report the same data as ``devshim info --json``, for a program that wants it without a subprocess::

    import devshim_core

    info = devshim_core.activate()           # what `import devshim_core.auto` does; idempotent
    print(info.plugin, info.device_type, info.reason)
    devshim_core.active_session()            # the same, later; None if devshim was never activated

Everything else in ``devshim_core`` is internal unless the plugin-authoring guide names it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class SessionInfo:
    """A snapshot of devshim's state in this process, taken when it was asked for.

    Integrations armed for a framework that was not imported yet say so (``"armed: ..."``); a later
    :func:`active_session` shows them applied once the script has imported the framework (each integration reports
    the moment its sets fire).
    """

    plugin: str
    """The selected plugin's name (its ``devshim`` entry-point name)."""
    device_type: str
    """The torch device type the plugin serves (``"cpu"``, ``"npu"``, ...)."""
    reason: str
    """Why this plugin was selected (forced by ``DEVSHIM_PLUGIN``, or the highest priority available)."""
    device: Mapping[str, Any]
    """The device facade: count, backend, dtypes, which kernels the plugin provides."""
    plugins: tuple[Mapping[str, Any], ...]
    """Every discovered plugin, with its distribution, version and availability."""
    integrations: Mapping[str, str]
    """Per integration (``deepspeed``, ``megatron``, ``cuda-redirect``, ...), what devshim did or why not."""
    patches: tuple[Mapping[str, Any], ...]
    """One row per applied patch: set, name, target, reason, required and installed versions."""
    emulation: str | None = None
    """A notice when the device is devshim's emulation (``DEVSHIM_EMULATE``), not hardware."""
    warnings: tuple[str, ...] = ()
    """What activation printed on stderr: the plugins passed over for the selected one, and why."""
    disabled: tuple[Mapping[str, Any], ...] = ()
    """One row per patch set or single patch left out by ``DEVSHIM_DISABLE``: set, patch (``None``: the whole
    set) and reason."""

    def as_dict(self) -> dict[str, Any]:
        """Plain data under the keys ``devshim info --json`` uses for the same facts."""
        report: dict[str, Any] = {
            "selected": self.plugin,
            "reason": self.reason,
            "device": dict(self.device),
            "plugins": [dict(p) for p in self.plugins],
            "integrations": dict(self.integrations),
            "patches": [dict(p) for p in self.patches],
            "disabled": [dict(d) for d in self.disabled],
        }
        if self.emulation is not None:
            report["emulation"] = self.emulation
        if self.warnings:
            report["warnings"] = list(self.warnings)
        return report


def emulation_notice(vendor: str, device_type: str) -> str:
    return (f"EMULATED DEVICE -- NOT HARDWARE: DEVSHIM_EMULATE={vendor}: '{device_type}' is devshim's host-memory "
            f"emulation with a simulated {vendor} SDK; no {vendor} hardware or vendor software is in use, and "
            "nothing measured here says anything about real devices.")


def _snapshot(session: Any) -> SessionInfo:
    from devshim_core.patching import REGISTRY

    vendor = session.settings.emulate
    return SessionInfo(
        plugin=session.selection.plugin.name,
        device_type=session.device.type,
        reason=session.selection.reason,
        device=MappingProxyType(session.device.describe()),
        plugins=tuple(MappingProxyType(r.as_dict()) for r in session.registry),
        integrations=MappingProxyType(dict(session.integrations)),
        patches=tuple(MappingProxyType(row) for row in REGISTRY.report()),
        emulation=None if vendor is None else emulation_notice(vendor, session.device.type),
        warnings=tuple(session.warnings),
        disabled=tuple(MappingProxyType(row) for row in REGISTRY.disabled_report()),
    )


def activate() -> SessionInfo:
    """Activate devshim in this process, exactly as ``import devshim_core.auto`` does, and describe the result.

    Reads the ``DEVSHIM_*`` environment. Idempotent: a second call (or one after ``import devshim_core.auto``)
    activates nothing more and describes the same session.

    Raises:
        devshim_core.errors.DevshimError: no plugin could be selected, a setting is invalid, or a patch could
            not be applied (nothing stays half-patched). The message says what to change.
    """
    from devshim_core import session

    return _snapshot(session.activate())


def active_session() -> SessionInfo | None:
    """devshim's state now, or ``None`` if devshim has not been activated in this process. Never activates."""
    session = sys.modules.get("devshim_core.session")  # not imported: never activated (and torch stays unloaded)
    active = None if session is None else session.current()
    return None if active is None else _snapshot(active)
