"""devshim's environment switches, parsed once and validated with actionable errors."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from devshim_core.errors import ConfigError

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use 1 or 0 (also accepted: true/false, yes/no, on/off).")


def parse_names(environ: Mapping[str, str], name: str) -> tuple[str, ...]:
    raw = environ.get(name, "")
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    for item in names:
        if not item.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{name}={raw!r}: {item!r} is not a plugin name; use a comma-separated list such as "
                              "'ascend,sophgo' (see `devshim plugins`).")
    return names


def _emulated_vendor(environ: Mapping[str, str]) -> str | None:
    if not environ.get("DEVSHIM_EMULATE", "").strip():
        return None  # the common case: the emulation package is not even imported
    from devshim_core.emulation import requested_vendor

    return requested_vendor(environ)


@dataclass(frozen=True)
class Settings:
    """The switches that steer discovery, selection and patching."""

    forced: str | None = None  # DEVSHIM_PLUGIN
    disabled: tuple[str, ...] = ()  # DEVSHIM_DISABLED_PLUGINS
    autoload: bool = True  # not DEVSHIM_DISABLE_PLUGIN_AUTOLOAD
    allowlist: tuple[str, ...] = ()  # DEVSHIM_PLUGINS (with autoload off)
    patch_deepspeed: bool = True  # DEVSHIM_PATCH_DEEPSPEED
    patch_megatron: bool = True  # DEVSHIM_PATCH_MEGATRON
    redirect_cuda: bool = True  # DEVSHIM_REDIRECT_CUDA (only ever applied when the device is not CUDA)
    patch_distributed: bool = True  # DEVSHIM_PATCH_DISTRIBUTED: clean exits, named timeouts, plugin agreement
    shared_memory_collectives: bool = True  # DEVSHIM_SHARED_MEMORY_COLLECTIVES: one host's CPU collectives via /dev/shm
    emulate: str | None = None  # DEVSHIM_EMULATE: the vendor whose simulated SDK and emulated device to use

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        forced_names = parse_names(env, "DEVSHIM_PLUGIN")
        if len(forced_names) > 1:
            raise ConfigError(f"DEVSHIM_PLUGIN={env['DEVSHIM_PLUGIN']!r} names several plugins; it forces exactly one. "
                              "To restrict discovery to several, use DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 with "
                              "DEVSHIM_PLUGINS=a,b.")
        forced = forced_names[0] if forced_names else None
        settings = cls(
            forced=forced,
            disabled=parse_names(env, "DEVSHIM_DISABLED_PLUGINS"),
            autoload=not parse_bool(env, "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD", False),
            allowlist=parse_names(env, "DEVSHIM_PLUGINS"),
            patch_deepspeed=parse_bool(env, "DEVSHIM_PATCH_DEEPSPEED", True),
            patch_megatron=parse_bool(env, "DEVSHIM_PATCH_MEGATRON", True),
            redirect_cuda=parse_bool(env, "DEVSHIM_REDIRECT_CUDA", True),
            patch_distributed=parse_bool(env, "DEVSHIM_PATCH_DISTRIBUTED", True),
            shared_memory_collectives=parse_bool(env, "DEVSHIM_SHARED_MEMORY_COLLECTIVES", True),
            emulate=_emulated_vendor(env),
        )
        if forced is not None and forced in settings.disabled:
            raise ConfigError(f"DEVSHIM_PLUGIN={forced} forces a plugin that DEVSHIM_DISABLED_PLUGINS also blocks; "
                              "remove it from one of the two.")
        if not settings.autoload and not settings.allowlist and forced is None:
            raise ConfigError("DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 loads only the plugins named in DEVSHIM_PLUGINS, "
                              "and it is empty: set e.g. DEVSHIM_PLUGINS=cpu_reference (see `devshim plugins`).")
        return settings

    def wants_loaded(self, name: str) -> str | None:
        """Why the plugin ``name`` is not to be loaded, or ``None`` when it is."""
        if name in self.disabled:
            return "blocked by DEVSHIM_DISABLED_PLUGINS"
        if not self.autoload and name not in self.allowlist and name != self.forced:
            return "not loaded: DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 and it is not in DEVSHIM_PLUGINS"
        return None
