"""devshim's environment switches, parsed once and validated with actionable errors (each declared in
:mod:`devshim_core.switches`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from devshim_core import log, switches
from devshim_core.env_values import parse_bool
from devshim_core.errors import ConfigError

__all__ = ["Settings", "parse_bool", "parse_names", "parse_seconds"]


def parse_names(environ: Mapping[str, str], name: str) -> tuple[str, ...]:
    raw = environ.get(name, "")
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    for item in names:
        if not item.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{name}={raw!r}: {item!r} is not a plugin name; use a comma-separated list such as "
                              "'ascend,sophgo' (see `devshim plugins`).")
    return names


def parse_seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):  # also refuses nan
        raise ConfigError(f"{name}={raw!r} is not a number of seconds: use e.g. {name}={default:g} "
                          "(0 turns the limit off).")
    return value


def parse_forced(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """DEVSHIM_PLUGIN: ``name`` or ``name@distribution`` (the latter picks one of two distributions that both
    register ``name``)."""
    raw = environ.get("DEVSHIM_PLUGIN", "")
    name, _, distribution = raw.partition("@")
    names = parse_names({"DEVSHIM_PLUGIN": name}, "DEVSHIM_PLUGIN") if name.strip() or not distribution else ()
    if len(names) > 1:
        raise ConfigError(f"DEVSHIM_PLUGIN={raw!r} names several plugins; it forces exactly one. "
                          "To restrict discovery to several, use DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 with "
                          "DEVSHIM_PLUGINS=a,b.")
    distribution = distribution.strip()
    if "@" in raw and (not names or not distribution or "@" in distribution):
        raise ConfigError(f"DEVSHIM_PLUGIN={raw!r}: write a plugin name, or name@distribution to pick the "
                          "distribution of a name that two distributions register (e.g. "
                          "cpu_reference@devshim-cpu-reference; see `devshim plugins`).")
    return (names[0] if names else None), (distribution or None)


DEFAULT_DETECT_TIMEOUT = 10.0
_WARNED: set[str] = set()  # the warnings this process has printed


def _emulated_vendor(environ: Mapping[str, str]) -> str | None:
    if not environ.get("DEVSHIM_EMULATE", "").strip():
        return None  # the common case: the emulation package is not even imported
    from devshim_core.emulator import requested_vendor

    return requested_vendor(environ)


@dataclass(frozen=True)
class Settings:
    """The switches that steer discovery, selection and patching."""

    forced: str | None = None  # DEVSHIM_PLUGIN (its name part)
    forced_distribution: str | None = None  # DEVSHIM_PLUGIN=name@distribution
    disabled: tuple[str, ...] = ()  # DEVSHIM_DISABLED_PLUGINS
    autoload: bool = True  # not DEVSHIM_DISABLE_PLUGIN_AUTOLOAD
    allowlist: tuple[str, ...] = ()  # DEVSHIM_PLUGINS (with autoload off)
    patch_deepspeed: bool = True  # DEVSHIM_PATCH_DEEPSPEED
    patch_megatron: bool = True  # DEVSHIM_PATCH_MEGATRON
    redirect_cuda: bool = True  # DEVSHIM_REDIRECT_CUDA (only ever applied when the device is not CUDA)
    patch_distributed: bool = True  # DEVSHIM_PATCH_DISTRIBUTED: clean exits, named timeouts, plugin agreement
    shared_memory_collectives: bool = True  # DEVSHIM_SHARED_MEMORY_COLLECTIVES: one host's CPU collectives via /dev/shm
    emulate: str | None = None  # DEVSHIM_EMULATE: the vendor whose simulated SDK and emulated device to use
    require_device: str | None = None  # DEVSHIM_REQUIRE_DEVICE: a selection of another device type is an error
    detect_timeout: float = DEFAULT_DETECT_TIMEOUT  # DEVSHIM_DETECT_TIMEOUT: seconds per plugin's detection, 0 = none
    cuda_facade: bool = False  # DEVSHIM_CUDA_FACADE: on a CUDA device, route DeepSpeed through devshim's facade
    disable: tuple[str, ...] = ()  # DEVSHIM_DISABLE: integrations, patch sets and set:patch entries turned off
    reference_kernels: bool = False  # DEVSHIM_REFERENCE_KERNELS: devshim-kernels' ops in place of the plugin's

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        forced, forced_distribution = parse_forced(env)
        required = env.get("DEVSHIM_REQUIRE_DEVICE", "").strip() or None
        if required is not None and not required.isidentifier():
            raise ConfigError(f"DEVSHIM_REQUIRE_DEVICE={env['DEVSHIM_REQUIRE_DEVICE']!r} is not a torch device type: "
                              "write the type the job must run on, e.g. DEVSHIM_REQUIRE_DEVICE=npu (or cuda, tpu, "
                              "cpu).")
        settings = cls(
            forced=forced,
            forced_distribution=forced_distribution,
            disabled=parse_names(env, "DEVSHIM_DISABLED_PLUGINS"),
            autoload=not parse_bool(env, "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD", False),
            allowlist=parse_names(env, "DEVSHIM_PLUGINS"),
            patch_deepspeed=parse_bool(env, "DEVSHIM_PATCH_DEEPSPEED", True),
            patch_megatron=parse_bool(env, "DEVSHIM_PATCH_MEGATRON", True),
            redirect_cuda=parse_bool(env, "DEVSHIM_REDIRECT_CUDA", True),
            patch_distributed=parse_bool(env, "DEVSHIM_PATCH_DISTRIBUTED", True),
            shared_memory_collectives=parse_bool(env, "DEVSHIM_SHARED_MEMORY_COLLECTIVES", True),
            emulate=_emulated_vendor(env),
            require_device=required,
            detect_timeout=parse_seconds(env, "DEVSHIM_DETECT_TIMEOUT", DEFAULT_DETECT_TIMEOUT),
            cuda_facade=parse_bool(env, "DEVSHIM_CUDA_FACADE", False),
            disable=tuple(dict.fromkeys(item.strip() for item in env.get("DEVSHIM_DISABLE", "").split(",")
                                        if item.strip())),
            reference_kernels=parse_bool(env, "DEVSHIM_REFERENCE_KERNELS", False),
        )
        for warning in switches.check_environment(env):  # after the parsers above, whose messages are specific
            if warning not in _WARNED:  # settings are read more than once (devshim info, the kit): say it once
                _WARNED.add(warning)
                log.logger().warning(warning)
        if forced is not None and forced in settings.disabled:
            raise ConfigError(f"DEVSHIM_PLUGIN={forced} forces a plugin that DEVSHIM_DISABLED_PLUGINS also blocks; "
                              "remove it from one of the two.")
        if not settings.autoload and not settings.allowlist and forced is None:
            raise ConfigError("DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 loads only the plugins named in DEVSHIM_PLUGINS, "
                              "and it is empty: set e.g. DEVSHIM_PLUGINS=cpu_reference (see `devshim plugins`).")
        return settings

    def switched_off(self, integration: str) -> str | None:
        """Why the integration (``deepspeed``, ``megatron``, ``cuda-redirect``) is off, or ``None``: named in
        DEVSHIM_DISABLE, or by its boolean alias."""
        if integration in self.disable:
            return f"DEVSHIM_DISABLE={integration}"
        aliases = {"deepspeed": (self.patch_deepspeed, "DEVSHIM_PATCH_DEEPSPEED=0"),
                   "megatron": (self.patch_megatron, "DEVSHIM_PATCH_MEGATRON=0"),
                   "cuda-redirect": (self.redirect_cuda, "DEVSHIM_REDIRECT_CUDA=0")}
        on, alias = aliases.get(integration, (True, ""))
        return None if on else alias

    def disabled_patches(self) -> dict[str, str]:
        """DEVSHIM_DISABLE's entries, each with why, for :meth:`devshim_core.patching.PatchRegistry.disable`."""
        return {name: f"disabled by DEVSHIM_DISABLE={name}" for name in self.disable}

    def wants_loaded(self, name: str) -> str | None:
        """Why the plugin ``name`` is not to be loaded, or ``None`` when it is."""
        if name in self.disabled:
            return "blocked by DEVSHIM_DISABLED_PLUGINS"
        if not self.autoload and name not in self.allowlist and name != self.forced:
            return "not loaded: DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 and it is not in DEVSHIM_PLUGINS"
        return None
