"""Plugin discovery: load every ``devshim`` entry point tolerantly and ask each one to detect its device.

A plugin that fails to import, breaks the hook contract, raises in detection, answers nonsense or does not answer
within the detection time limit is recorded with its error and skipped; the others keep working. A forced plugin
(``DEVSHIM_PLUGIN``) is the only one loaded and detected. A name that two distributions register is refused for
both unless ``DEVSHIM_PLUGIN=name@distribution`` picks one. Nothing here touches a framework.
"""

from __future__ import annotations

import importlib.metadata as metadata
import threading
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pluggy

from devshim_core import hookspecs, log, switches
from devshim_core.distributions import name_and_version
from devshim_core.errors import PluginError
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

    def __iter__(self) -> Iterator[PluginRecord]:
        return iter(self.records.values())

    def names(self) -> list[str]:
        return list(self.records)

    # -- loading ------------------------------------------------------------------------------

    def add(self, record: PluginRecord, loader: Any) -> None:
        """Load ``record``'s plugin with ``loader()`` (an entry point's ``load`` or a constant) and register it:
        one object per plugin, whose hook implementations are the plugin's answers. A record whose name is taken
        already is kept under ``name@distribution``; :func:`discover` refuses such names before loading them."""
        key = record.name if record.name not in self.records else f"{record.name}@{record.distribution}"
        self.records[key] = record
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

    def ask(self, record: PluginRecord, hook: str) -> Any:
        """The selected plugin's answer to ``hook`` (given its report), as :meth:`call`; a hook that raises becomes a
        :class:`~devshim_core.errors.PluginError` naming the plugin, the hook and the traceback, and what to do."""
        try:
            return self.call(record, hook, report=record.report)
        except Exception as exc:
            raise PluginError(f"plugin {record.name!r} raised in {hook}: {type(exc).__name__}: {exc}\n"
                              f"{traceback.format_exc()}\nForce another plugin with DEVSHIM_PLUGIN=<name> or block "
                              f"this one with DEVSHIM_DISABLED_PLUGINS={record.name}.") from exc

    def detect(self, record: PluginRecord, timeout: float = 0.0) -> None:
        """Ask ``record``'s plugin for its report, waiting at most ``timeout`` seconds (0: no limit). A plugin that
        does not answer in time is recorded as timed out; its detection goes on in a daemon thread, ignored."""
        outcome: dict[str, Any] = {}

        def ask() -> None:
            try:
                outcome["report"] = self.call(record, "devshim_detect")
            except BaseException as exc:  # like import: a plugin's sys.exit() must not end discovery (or pip)
                outcome["error"], outcome["detail"] = exc, traceback.format_exc()

        if timeout > 0:
            worker = threading.Thread(target=ask, name=f"devshim-detect-{record.name}", daemon=True)
            worker.start()
            worker.join(timeout)
            if worker.is_alive():
                record.error = (f"detection timed out after {timeout:g} s (the plugin's devshim_detect did not "
                                "return; raise the limit with DEVSHIM_DETECT_TIMEOUT=<seconds>, or block the plugin "
                                f"with DEVSHIM_DISABLED_PLUGINS={record.name})")
                return
        else:
            ask()
        if "error" in outcome:
            exc = outcome["error"]
            if isinstance(exc, KeyboardInterrupt):
                raise exc
            record.error = f"detection raised {_short_error(exc)}"
            record.error_detail = outcome["detail"]
            return
        report = outcome["report"]
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


def _origin(record: PluginRecord) -> str:
    return f"{record.distribution} {record.version}" if record.distribution else str(record.entry_point)


def _refuse_conflicts(candidates: list[tuple[PluginRecord, Any]], settings: Settings) -> None:
    """Two distributions registering one name: neither is loaded (which one would win depends on nothing the user
    chose), unless ``DEVSHIM_PLUGIN=name@distribution`` picks one."""
    by_name: dict[str, list[PluginRecord]] = {}
    for record, _ in candidates:
        by_name.setdefault(record.name, []).append(record)
    for name, records in by_name.items():
        if len(records) < 2:
            continue
        origins = " and ".join(_origin(r) for r in records)
        picked = settings.forced_distribution if settings.forced == name else None
        for record in records:
            if picked is not None and record.distribution == picked:
                continue
            if record.skipped:
                continue
            record.skipped = (f"conflict: plugin name {name!r} is registered by {origins}; devshim loads "
                              f"{'only ' + picked if picked else 'neither'}. Uninstall one, or pick one with "
                              f"DEVSHIM_PLUGIN={name}@<distribution>")


def _warn_unknown(settings: Settings, installed: list[str]) -> None:
    """A name in DEVSHIM_DISABLED_PLUGINS that no installed plugin has blocks nothing: say so, with the nearest name.
    (DEVSHIM_PLUGIN and DEVSHIM_PLUGINS naming an unknown plugin are errors, at selection.)"""
    for name in settings.disabled:
        if name not in installed:
            guess = switches.nearest(name, installed)
            log.logger().warning(f"DEVSHIM_DISABLED_PLUGINS names {name!r}, which is not an installed plugin"
                                 f"{f' (did you mean {guess}?)' if guess else ''}; it blocks nothing.")


def discover(settings: Settings, extra: Iterable[tuple[str, Any]] = ()) -> PluginRegistry:
    """Load and detect every plugin of the ``devshim`` entry-point group (plus ``extra`` (name, plugin)
    pairs registered in-process, for embedding) according to ``settings``."""
    registry = PluginRegistry()
    entry_points = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP),
                          key=lambda ep: (ep.name, _distribution_of(ep)[0] or ""))
    candidates: list[tuple[PluginRecord, Any]] = []
    for ep in entry_points:
        distribution, version = _distribution_of(ep)
        candidates.append((PluginRecord(name=ep.name, distribution=distribution, version=version,
                                        entry_point=ep.value, skipped=settings.wants_loaded(ep.name)), ep.load))
    for name, plugin in extra:
        candidates.append((PluginRecord(name=name, entry_point="<in-process>", skipped=settings.wants_loaded(name)),
                           lambda plugin=plugin: plugin))
    if settings.forced in {record.name for record, _ in candidates}:  # a hung or crashing plugin cannot stop it
        for record, _ in candidates:
            if record.name != settings.forced and not record.skipped:
                record.skipped = (f"not loaded: DEVSHIM_PLUGIN={settings.forced} is forced, and only it is loaded "
                                  "and detected")
    _refuse_conflicts(candidates, settings)
    _warn_unknown(settings, sorted({record.name for record, _ in candidates}))
    if settings.forced_distribution is not None and not any(
            r.name == settings.forced and r.distribution == settings.forced_distribution for r, _ in candidates):
        from devshim_core.errors import SelectionError

        raise SelectionError(f"DEVSHIM_PLUGIN={settings.forced}@{settings.forced_distribution}: no installed "
                             f"distribution named {settings.forced_distribution!r} registers the plugin "
                             f"{settings.forced!r} (see `devshim plugins`).")
    # the picked distribution of a conflicting name goes first among its namesakes, so that it holds the plain name
    first: dict[str, int] = {}
    for index, (record, _) in enumerate(candidates):
        first.setdefault(record.name, index)
    candidates.sort(key=lambda item: (first[item[0].name], item[0].skipped is not None))
    for record, loader in candidates:
        registry.add(record, loader)
    for record in registry:
        if record.plugin is not None:
            registry.detect(record, settings.detect_timeout)
    return registry
