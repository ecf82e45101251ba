"""The job's CUDA/NCCL environment, migrated to the selected plugin's own variables at activation.

A job script written for NVIDIA sets ``CUDA_VISIBLE_DEVICES``, ``PYTORCH_CUDA_ALLOC_CONF``, ``NCCL_*`` and
``TORCH_NCCL_*``; a vendor runtime reads only its own names (``ASCEND_RT_VISIBLE_DEVICES``, ``HCCL_*``), so those
settings would be silently lost. The selected plugin declares the mapping (``devshim_environment_map``); this module
sets each vendor variable the user did not set, before the device facade is built (before the vendor runtime reads
its variables), logs each translation, names in one warning what has no effect on the device, and reverts what it
set when devshim deactivates. A plugin that declares no mapping (``cuda``) changes nothing.

The helpers :func:`visible_devices` and :func:`allocator_config` are converters a plugin may use in its
:class:`~devshim_core.records.EnvironmentMap`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from devshim_core import log, migration_log
from devshim_core.allocator_config import split_items
from devshim_core.errors import ConfigError, PluginError
from devshim_core.record_checks import check_environment_map
from devshim_core.records import EnvironmentConverter, EnvironmentMap

HOOK = "devshim_environment_map"
SOURCE_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")
SOURCE_PREFIXES = ("NCCL_", "TORCH_NCCL_")

# what torchrun's agent sets in every worker unless the user did: not the user's setting, so never warned about
LAUNCHER_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}

APPLIED, SAME, KEPT = "applied", "already set", "not applied"
UNTRANSLATABLE, IGNORED = "untranslatable", "ignored"


def is_source(name: str) -> bool:
    """Whether ``name`` is one of the CUDA/NCCL settings devshim migrates."""
    return name in SOURCE_NAMES or name.startswith(SOURCE_PREFIXES)


def job_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The CUDA/NCCL settings present in ``environ``, by name."""
    return {name: environ[name] for name in sorted(environ) if is_source(name)}


@dataclass(frozen=True)
class Translation:
    """What became of one CUDA/NCCL setting: ``applied`` (devshim set ``target``), ``already set`` (``target`` holds
    the translated value already: a launcher, or a parent process, set it), ``not applied`` (``target`` is set to
    another value, which wins), ``untranslatable`` or ``ignored`` (means nothing on this device)."""

    source: str
    value: str
    outcome: str
    target: str | None = None
    target_value: str | None = None
    note: str = ""

    def describe(self) -> str:
        if self.outcome == APPLIED:
            return (f"{self.source}={self.value!r} -> {self.target}={self.target_value!r}"
                    + (f" ({self.note})" if self.note else ""))
        if self.outcome == SAME:
            return f"{self.source}={self.value!r}: {self.target}={self.target_value!r} is set already"
        if self.outcome == KEPT:
            return (f"{self.source}={self.value!r} not applied: {self.target}={self.target_value!r} is set "
                    "already, and the vendor variable you set wins")
        if self.outcome == IGNORED:
            return f"{self.source}={self.value!r} ignored: it means nothing on this device"
        return f"{self.source}={self.value!r} untranslatable: {self.note or 'the device has no equivalent'}"

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "value": self.value, "outcome": self.outcome, "target": self.target,
                "target_value": self.target_value, "note": self.note, "summary": self.describe()}


@dataclass
class Migration:
    """The translations made for ``plugin`` at one activation, and what devshim set (to revert it)."""

    plugin: str
    translations: list[Translation] = field(default_factory=list)
    set_by_devshim: dict[str, str] = field(default_factory=dict)

    def warning(self) -> str | None:
        """One message naming every setting that has no effect on the device, or ``None``."""
        lost = [t for t in self.translations if t.outcome in (KEPT, UNTRANSLATABLE)]
        if not lost:
            return None
        return (f"these CUDA/NCCL settings of the job have no effect on the {self.plugin} device: "
                + "; ".join(t.describe() for t in lost)
                + ". Set the vendor's own variable where there is one (devshim info lists every translation).")

    def revert(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Unset what devshim set, unless something changed it since."""
        env = os.environ if environ is None else environ
        for name, value in self.set_by_devshim.items():
            if env.get(name) == value:
                del env[name]
        self.set_by_devshim.clear()

    def as_dict(self) -> dict[str, Any]:
        return {"plugin": self.plugin, "translations": [t.as_dict() for t in self.translations]}


def _ignored(name: str, ignored: Iterable[str]) -> bool:
    return any(name == rule or (rule.endswith("_") and name.startswith(rule)) for rule in ignored)


def plan(mapping: EnvironmentMap, settings: dict[str, str], environ: Mapping[str, str]) -> list[Translation]:
    """What each CUDA/NCCL setting becomes under ``mapping``, given the vendor variables already in ``environ``."""
    translations = []
    for source, value in settings.items():
        target = mapping.variables.get(source)
        if target is None:
            launcher = LAUNCHER_DEFAULTS.get(source) == value
            outcome = IGNORED if launcher or _ignored(source, mapping.ignored) else UNTRANSLATABLE
            note = "torchrun's default in every worker" if launcher else (
                "" if outcome == IGNORED else "the device has no documented equivalent")
            translations.append(Translation(source, value, outcome, note=note))
            continue
        converter = mapping.convert.get(source)
        converted, note = converter(value) if converter is not None else (value, "")
        if not isinstance(converted, (str, type(None))) or not isinstance(note, str):
            raise TypeError(f"converting {source} gave {(converted, note)!r:.80}, expected (str or None, str)")
        if target in environ:  # the user's (or the launcher's) vendor variable wins
            outcome = SAME if environ[target] == converted else KEPT
            translations.append(Translation(source, value, outcome, target, environ[target]))
        elif converted is None:
            translations.append(Translation(source, value, UNTRANSLATABLE, target, note=note))
        else:
            translations.append(Translation(source, value, APPLIED, target, converted, note))
    return translations


def migrate(registry: Any, record: Any, detect_timeout: float = 0.0, *, announce: bool = True,
            environ: MutableMapping[str, str] | None = None) -> Migration | None:
    """Ask the selected plugin (``record``) for its map and apply it to ``environ`` (``os.environ``); ``None`` when
    the plugin declares none. When anything was set, the plugin detects its device again (the report then counts
    what the runtime sees); a device that is no longer usable raises :class:`ConfigError` naming the translation.
    ``announce``: log the translations and the warning (rank 0 only, as the session's other messages)."""
    env = os.environ if environ is None else environ
    mapping = registry.ask(record, HOOK)
    if mapping is None:
        return None
    check_environment_map(mapping, record.name, HOOK)
    try:
        migration = Migration(record.name, plan(mapping, job_settings(env), env))
    except Exception as exc:  # a converter's bug: say whose, as for a hook that raises
        raise PluginError(f"plugin {record.name!r}: a converter of its {HOOK} raised {type(exc).__name__}: {exc}. "
                          f"Unset the CUDA/NCCL variable it converts, or block the plugin with "
                          f"DEVSHIM_DISABLED_PLUGINS={record.name}.") from exc
    for translation in migration.translations:
        if translation.outcome == APPLIED:
            assert translation.target is not None and translation.target_value is not None
            env[translation.target] = translation.target_value
            migration.set_by_devshim[translation.target] = translation.target_value
    migration_log.record_translations(migration.translations)
    if migration.set_by_devshim:
        _detect_again(registry, record, detect_timeout, migration, env)
    if announce:
        logger = log.logger("env")
        for translation in migration.translations:
            if translation.outcome == APPLIED:
                logger.info("for the %s device: %s", record.name, translation.describe())
        warning = migration.warning()
        if warning is not None:
            logger.warning(warning)
    return migration


def _detect_again(registry: Any, record: Any, timeout: float, migration: Migration,
                  environ: MutableMapping[str, str]) -> None:
    registry.detect(record, timeout)  # a selected plugin had no error: one now is this detection's
    if record.error is None and record.report.available:
        return
    reason = record.error or record.report.reason
    applied = ", ".join(t.describe() for t in migration.translations if t.outcome == APPLIED)
    migration.revert(environ)
    raise ConfigError(f"devshim translated the job's CUDA/NCCL settings for the {record.name} plugin ({applied}), and "
                      f"then its device was no longer usable: {reason}. Fix those settings, or set the vendor "
                      "variables yourself (devshim never overrides one you set).")


# -- converters plugins share ---------------------------------------------------------------------------------------


def visible_devices(value: str) -> tuple[str | None, str]:
    """``CUDA_VISIBLE_DEVICES`` as device indices (``"0,2"``) carries over as it is; GPU UUIDs and MIG ids do not."""
    items = [item.strip() for item in value.split(",")]
    if all(item.isdigit() for item in items):
        return ",".join(items), ""
    return None, "only device indices carry over (e.g. 0,1), not GPU UUIDs or MIG ids"


def allocator_config(keys: Iterable[str], validate: Callable[[str], None] | None = None) -> EnvironmentConverter:
    """A converter of ``PYTORCH_CUDA_ALLOC_CONF`` keeping the ``keys`` the vendor allocator reads, dropping (and
    naming) the others; a result ``validate`` refuses is not carried over, with its reason."""
    known = frozenset(keys)

    def convert(value: str) -> tuple[str | None, str]:
        try:
            items = split_items(value)
        except ValueError as exc:
            return None, str(exc)
        kept = [item for item in items if item.partition(":")[0].strip() in known]
        dropped = [item.partition(":")[0].strip() for item in items if item not in kept]
        note = f"dropped {', '.join(dropped)}, which the device's allocator does not read" if dropped else ""
        if not kept:
            return None, note or "no settings"
        result = ",".join(kept)
        if validate is not None:
            try:
                validate(result)
            except ValueError as exc:
                return None, f"{result!r} is not valid for the device's allocator: {exc}"
        return result, note

    return convert
