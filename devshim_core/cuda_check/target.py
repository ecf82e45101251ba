"""Where the CUDA redirect would send a script on this machine, found by discovery and selection alone.

Nothing is activated or patched: the selected plugin is only asked for its detection report and its
collectives answer (backend and visible-devices variable), which is what the report needs to be specific.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from devshim_core.errors import DevshimError
from devshim_core.plugins import discover
from devshim_core.records import CollectivesSpec
from devshim_core.selection import select
from devshim_core.settings import Settings, parse_bool

REDIRECT_SWITCH = "DEVSHIM_REDIRECT_CUDA"
# the variables each plugin family uses, for when no plugin can be selected here
EXAMPLE_VISIBLE_DEVICES = "the plugin's visible-devices variable (ASCEND_RT_VISIBLE_DEVICES for ascend)"


@dataclass(frozen=True)
class Target:
    """The selected plugin's device (``None`` when selection failed, with ``reason`` saying why)."""

    redirect: bool = True
    plugin: str | None = None
    device_type: str | None = None
    backend: str | None = None
    visible_devices_env: str | None = None
    reason: str = ""
    emulated: str | None = None  # DEVSHIM_EMULATE's vendor: the device is devshim's emulation, not hardware
    # devshim's Megatron integration provides and blocks the CUDA extension modules here: Megatron is importable and
    # the integration is not switched off (without it a CUDA-only package imports, if installed, and fails when used)
    megatron: bool = True

    @property
    def device(self) -> str:
        return self.device_type or "the selected device"

    def words(self) -> dict[str, str]:
        """What the rules' messages are formatted with."""
        return {
            "device": self.device,
            "backend": f"'{self.backend}'" if self.backend else "the plugin's backend",
            "visible": self.visible_devices_env or EXAMPLE_VISIBLE_DEVICES,
        }


def redirect_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``DEVSHIM_REDIRECT_CUDA``, on by default; a value that is not a boolean raises ConfigError."""
    return parse_bool(os.environ if environ is None else environ, REDIRECT_SWITCH, True)


# what DEVSHIM_DISABLE names to leave the extension modules alone: the integration, its set, or the set's one patch
_EXTENSION_MODULES_OFF = ("megatron", "megatron-extension-modules", "megatron-extension-modules:cuda-extension-modules")


def _megatron_modules(settings: Settings | None) -> bool:
    """Whether devshim provides and blocks the CUDA extension modules: Megatron is found on disk (never run), and
    neither the Megatron integration, nor the redirect it needs, nor its module set is switched off."""
    from devshim_core.integrations.megatron.install import _megatron_present

    if settings is not None and (settings.switched_off("megatron") or settings.switched_off("cuda-redirect")
                                 or any(name in settings.disable for name in _EXTENSION_MODULES_OFF)):
        return False
    return _megatron_present()


def find_target(environ: Mapping[str, str] | None = None) -> Target:
    """Discover and select as ``devshim plugins`` does; never raises for a selection problem."""
    redirect = redirect_enabled(environ)
    megatron = _megatron_modules(None)
    try:
        settings = Settings.from_env(environ)
        megatron = _megatron_modules(settings)
        registry = discover(settings)
        record = select(registry, settings).plugin
    except DevshimError as exc:
        return Target(redirect=redirect, reason=str(exc).splitlines()[0], megatron=megatron)
    assert record.report is not None
    try:  # a plugin's collectives hook may fail on a broken install; the device type is still known
        spec = registry.call(record, "devshim_collectives", report=record.report) or CollectivesSpec("gloo")
    except Exception:
        spec = None
    visible = None
    if isinstance(spec, CollectivesSpec):
        visible = spec.visible_devices_envs[0] if spec.visible_devices_envs else "DEVSHIM_VISIBLE_DEVICES"
    return Target(redirect=redirect, plugin=record.name, device_type=record.report.device_type,
                  backend=spec.backend if isinstance(spec, CollectivesSpec) else None,
                  visible_devices_env=visible, emulated=settings.emulate, megatron=megatron)
