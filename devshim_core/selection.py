"""Selection: the plugins' availability reports in, one choice and the reason for it out."""

from __future__ import annotations

from dataclasses import dataclass

from devshim_core.errors import SelectionError
from devshim_core.plugins import PluginRecord, PluginRegistry
from devshim_core.settings import Settings


@dataclass(frozen=True)
class Selection:
    plugin: PluginRecord
    reason: str


def describe_plugins(registry: PluginRegistry) -> str:
    """One line per installed plugin with why it is, or is not, available (for error messages)."""
    if not registry.records:
        return "  (no devshim plugins are installed: pip install devshim-cpu-reference, or a vendor plugin)"
    lines = []
    for record in registry:
        origin = f"{record.distribution} {record.version}" if record.distribution else record.entry_point
        lines.append(f"  - {record.name} ({origin}): {record.reason}")
    return "\n".join(lines)


def _rank_key(record: PluginRecord) -> tuple[int, str]:
    assert record.report is not None
    return (-record.report.priority, record.name)


def select(registry: PluginRegistry, settings: Settings) -> Selection:
    """Choose the plugin to run on, or raise :class:`SelectionError` listing every plugin and why."""
    named = [("DEVSHIM_PLUGINS", name) for name in settings.allowlist]
    if settings.forced:
        named.append(("DEVSHIM_PLUGIN", settings.forced))
    for variable, name in named:
        if name not in registry.records:
            raise SelectionError(f"{variable} names {name!r}, which is not an installed devshim plugin. "
                                 f"Installed plugins:\n{describe_plugins(registry)}")
    if settings.forced:
        record = registry.records[settings.forced]
        if not record.available:
            raise SelectionError(f"DEVSHIM_PLUGIN={settings.forced} is forced but that plugin cannot be used: "
                                 f"{record.reason}.\nInstalled plugins:\n{describe_plugins(registry)}")
        return Selection(record, f"forced by DEVSHIM_PLUGIN={settings.forced}")

    candidates = sorted((r for r in registry if r.available), key=_rank_key)
    if not candidates:
        raise SelectionError("no devshim plugin is available on this machine. Installed plugins:\n"
                             f"{describe_plugins(registry)}")
    best = candidates[0]
    assert best.report is not None
    reason = f"highest priority ({best.report.priority}) of the available plugins"
    if len(candidates) == 1:
        reason = "the only available plugin"
    tied = [r.name for r in candidates[1:] if r.report is not None and r.report.priority == best.report.priority]
    if tied:
        reason += (f"; tied at priority {best.report.priority} with {', '.join(tied)}, chosen by name order "
                   f"(force one with DEVSHIM_PLUGIN=<name>)")
    others = [r.name for r in candidates[1:] if r.name not in tied]
    if others:
        reason += f"; also available: {', '.join(others)}"
    return Selection(best, reason)
