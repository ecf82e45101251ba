"""Plugin discovery: load every ``devshim`` entry point tolerantly and ask each one to detect its device.

A plugin that fails to import, breaks the hook contract, raises in detection or answers nonsense is
recorded with its error and skipped; the others keep working. Nothing here touches a framework.
"""

from __future__ import annotations

import importlib.metadata as metadata
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from devshim_core import hookspecs
from devshim_core.distributions import name_and_version
from devshim_core.records import DeviceReport
from devshim_core.settings import Settings

ENTRY_POINT_GROUP = "devshim"


@dataclass
class PluginRecord:
    """Everything known about one installed plugin, good or broken."""

    name: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None
    plugin: Any = None
    report: DeviceReport | None = None
    skipped: str | None = None  # why it was not loaded (blocked, not allow-listed, conflict)
    error: str | None = None  # why it is broken (import, contract, detection)
    error_detail: str | None = field(default=None, repr=False)

    @property
    def available(self) -> bool:
        return self.report is not None and self.report.available and self.error is None and self.skipped is None

    @property
    def reason(self) -> str:
        if self.skipped:
            return self.skipped
        if self.error:
            return f"broken: {self.error}"
        assert self.report is not None
        return self.report.reason if self.report.available else f"not available: {self.report.reason}"

    def as_dict(self) -> dict[str, Any]:
        report = self.report
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "available": self.available,
            "reason": self.reason,
            "priority": report.priority if report else None,
            "device_type": report.device_type if report else None,
            "device_count": report.device_count if report else 0,
            "error": self.error,
        }


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginRegistry:
    """The pluggy manager plus a record per discovered plugin, in discovery order."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}

    def __iter__(self):
        return iter(self.records.values())

    def names(self) -> list[str]:
        return list(self.records)

    # -- loading ------------------------------------------------------------------------------

    def add(self, record: PluginRecord, loader: Any) -> None:
        """Load ``record``'s plugin with ``loader()`` (an entry point's ``load`` or a constant) and register it:
        one object per plugin, whose hook implementations are the plugin's answers."""
        if record.name in self.records:
            first = self.records[record.name]
            record.skipped = (f"conflict: plugin name {record.name!r} is also provided by "
                              f"{first.distribution or first.entry_point}; this one was ignored "
                              "(uninstall one of the two distributions)")
            self.records[f"{record.name}@{record.distribution}"] = record
            return
        self.records[record.name] = record
        if record.skipped:
            return
        try:
            plugin = loader()
        except BaseException as exc:  # a plugin's import must never take the process down
            if isinstance(exc, KeyboardInterrupt):
                raise
            record.error = f"failed to import: {_short_error(exc)}"
            record.error_detail = traceback.format_exc()
            return
        try:
            self.manager.register(plugin, name=record.name)
        except Exception as exc:
            record.error = f"invalid plugin: {_short_error(exc)}"
            record.error_detail = traceback.format_exc()
            return
        unknown = self._unknown_hooks(plugin)
        if unknown:
            self.manager.unregister(plugin)
            record.error = (f"implements hooks that devshim does not define: {', '.join(unknown)} "
                            "(a typo, or a plugin built for another devshim version)")
            return
        record.plugin = plugin

    def _unknown_hooks(self, plugin: Any) -> list[str]:
        unknown = []
        for caller in self.manager.get_hookcallers(plugin) or []:
            if not caller.has_spec():
                unknown.append(caller.name)
        return sorted(unknown)

    # -- calling ------------------------------------------------------------------------------

    def call(self, record: PluginRecord, hook: str, **kwargs: Any) -> Any:
        """Call ``hook`` on one plugin only: its answer, or ``None`` when it answers ``None`` or does not
        implement the hook. ``devshim_patches`` (not firstresult) gives a list: ``[answer]``, or ``[]``."""
        others = [p for p in self.manager.get_plugins() if p is not record.plugin]
        caller = self.manager.subset_hook_caller(hook, remove_plugins=others)
        return caller(**kwargs)

    def detect(self, record: PluginRecord) -> None:
        try:
            report = self.call(record, "devshim_detect")
        except BaseException as exc:  # like import: a plugin's sys.exit() must not end discovery (or pip)
            if isinstance(exc, KeyboardInterrupt):
                raise
            record.error = f"detection raised {_short_error(exc)}"
            record.error_detail = traceback.format_exc()
            return
        if not isinstance(report, DeviceReport):
            record.error = (f"devshim_detect returned {type(report).__name__} ({report!r:.80}); "
                            "it must return a devshim_core.DeviceReport")
            return
        try:
            report.validate()
        except (TypeError, ValueError) as exc:
            record.error = f"devshim_detect returned an invalid report: {exc}"
            return
        record.report = report


def _distribution_of(entry_point: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return None, None
    return name_and_version(dist)


def discover(settings: Settings, extra: Iterable[tuple[str, Any]] = ()) -> PluginRegistry:
    """Load and detect every plugin of the ``devshim`` entry-point group (plus ``extra`` (name, plugin)
    pairs registered in-process, for embedding) according to ``settings``."""
    registry = PluginRegistry()
    entry_points = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP),
                          key=lambda ep: (ep.name, _distribution_of(ep)[0] or ""))
    for ep in entry_points:
        distribution, version = _distribution_of(ep)
        record = PluginRecord(name=ep.name, distribution=distribution, version=version, entry_point=ep.value,
                              skipped=settings.wants_loaded(ep.name))
        registry.add(record, ep.load)
    for name, plugin in extra:
        record = PluginRecord(name=name, entry_point="<in-process>", skipped=settings.wants_loaded(name))
        registry.add(record, lambda plugin=plugin: plugin)
    for record in registry:
        if record.plugin is not None:
            registry.detect(record)
    return registry
