"""Selection: the plugins' availability reports in, one choice and the reason for it out, loud about what it passed
over."""

from __future__ import annotations

from dataclasses import dataclass

from devshim_core.errors import SelectionError
from devshim_core.plugins import PluginRecord, PluginRegistry
from devshim_core.settings import Settings


@dataclass(frozen=True)
class Selection:
    plugin: PluginRecord
    reason: str
    passed_over: tuple[PluginRecord, ...] = ()
    """Installed plugins that could have outranked the chosen one but could not be used (broken, refused, timed out
    or not available); empty when the plugin was forced."""

    def fallback_warning(self) -> str | None:
        """The one line a user sees when a plugin was passed over, or ``None``."""
        if not self.passed_over:
            return None
        chosen = self.plugin
        assert chosen.report is not None
        over = "; ".join(f"{r.name} ({r.reason})" for r in self.passed_over)
        names = ",".join(r.name for r in self.passed_over)
        kind = chosen.report.device_type
        return (f"running on {chosen.name} ({kind}), passing over {over}. To run on {kind} and silence "
                f"this, set DEVSHIM_PLUGIN={chosen.name} or DEVSHIM_REQUIRE_DEVICE={kind} (or never load them: "
                f"DEVSHIM_DISABLED_PLUGINS={names}); to make it an error, DEVSHIM_REQUIRE_DEVICE=<the device type "
                "you expected>.")


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


def _passed_over(registry: PluginRegistry, best: PluginRecord) -> tuple[PluginRecord, ...]:
    """Installed plugins that were loaded (or refused for a name conflict) but could not be used, and that would have
    outranked ``best``: a broken one has no priority, so it always could have. Blocked ones were the user's choice."""
    assert best.report is not None
    over = []
    for record in registry:
        if record is best or record.available:
            continue
        if record.skipped and not record.skipped.startswith("conflict"):
            continue
        if record.report is not None and record.error is None and record.report.priority <= best.report.priority:
            continue
        over.append(record)
    return tuple(over)


def _check_required(selection: Selection, registry: PluginRegistry, settings: Settings) -> Selection:
    required = settings.require_device
    chosen = selection.plugin
    assert chosen.report is not None
    if required is not None and chosen.report.device_type != required:
        raise SelectionError(f"DEVSHIM_REQUIRE_DEVICE={required}, but the selected plugin {chosen.name} runs on "
                             f"{chosen.report.device_type!r} ({selection.reason}). Installed plugins:\n"
                             f"{describe_plugins(registry)}")
    if required is not None:  # the user said which device the job runs on: passing others over is expected
        return Selection(chosen, selection.reason)
    return selection


def select(registry: PluginRegistry, settings: Settings) -> Selection:
    """Choose the plugin to run on, or raise :class:`SelectionError` listing every plugin and why (also when
    ``DEVSHIM_REQUIRE_DEVICE`` names another device type than the chosen plugin's)."""
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
        return _check_required(Selection(record, f"forced by DEVSHIM_PLUGIN={settings.forced}"), registry, settings)

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
    return _check_required(Selection(best, reason, _passed_over(registry, best)), registry, settings)
