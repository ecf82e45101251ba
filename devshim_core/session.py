"""One activation per process: detect -> select -> build the device facade -> install the integrations."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from devshim_core import env_migration, log
from devshim_core.device import Device, build_device
from devshim_core.integrations import table
from devshim_core.integrations.base import Status
from devshim_core.patching import REGISTRY, PatchSet
from devshim_core.plugins import PluginRegistry, discover
from devshim_core.selection import Selection, select
from devshim_core.settings import Settings


@dataclass
class Session:
    settings: Settings
    registry: PluginRegistry
    selection: Selection
    device: Device
    integrations: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    environment: env_migration.Migration | None = None  # the CUDA/NCCL settings migrated to the plugin's variables


_lock = threading.RLock()
_active: Session | None = None


def _install_integrations(session: Session) -> None:
    settings, device = session.settings, session.device
    if device.patches:
        plugin_set = PatchSet(name=f"plugin-{device.plugin}", requires=(), patches=device.patches,
                              reason=f"device gaps handled by the {device.plugin} plugin")
        REGISTRY.apply(plugin_set, device)
        session.integrations[plugin_set.name] = f"applied ({len(device.patches)} patches)"

    if device.type == "cuda" and not settings.cuda_facade:
        # DeepSpeed, Megatron, apex, TransformerEngine and flash-attn work natively here: change nothing
        session.integrations["devshim"] = (
            "stands aside: the device is CUDA, so DeepSpeed and Megatron run their own CUDA paths and nothing is "
            "redirected or blocked (DEVSHIM_CUDA_FACADE=1 routes DeepSpeed through devshim's facade)")
        return

    for integration in table.load():
        status = Status(integration.name, session.integrations)
        why = settings.switched_off(integration.name) or integration.applies(device, settings)
        if why is not None:
            status.set(f"skipped: {why}")
            continue
        unmet = [need for need in integration.needs
                 if not session.integrations.get(need, "").startswith(("applied", "armed"))]
        if unmet:
            status.set("skipped: needs " + ", ".join(f"the {need} integration, which is "
                                                     f"{session.integrations.get(need, 'not installed')}"
                                                     for need in unmet))
            continue
        integration.install(device, settings, status)


def activate(environ: Mapping[str, str] | None = None, extra_plugins: Any = ()) -> Session:
    """Activate devshim in this process (idempotent: a second call returns the first session)."""
    global _active
    with _lock:
        if _active is not None:
            return _active
        settings = Settings.from_env(environ)
        if settings.emulate:  # the device must be up before the plugins look for it
            from devshim_core.emulator import bring_up

            bring_up(settings.emulate)
        registry = discover(settings, extra_plugins)
        selection = select(registry, settings)
        # before the facade is built: building it starts the vendor runtime, which reads its variables then
        environment = env_migration.migrate(registry, selection.plugin, settings.detect_timeout,
                                            announce=_is_rank_zero())
        try:
            device = build_device(registry, selection, settings.reference_kernels)
            device.prepare_process()
        except BaseException:
            if environment is not None:
                environment.revert()
            raise
        session = Session(settings, registry, selection, device, environment=environment)
        lost = environment.warning() if environment is not None else None
        if lost is not None:  # logged by migrate; kept for active_session() and devshim info
            session.warnings.append(lost)
        REGISTRY.disable(settings.disabled_patches())
        warning = selection.fallback_warning()
        if warning is not None:
            session.warnings.append(warning)
            if _is_rank_zero():
                log.logger().warning(warning)
        try:
            _install_integrations(session)
        except BaseException:
            deactivate_integrations()
            if environment is not None:
                environment.revert()
            raise
        _active = session
        return session


def _is_rank_zero() -> bool:
    """Rank 0 of a launched job, or a process that no launcher started (the launcher itself included)."""
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")).strip()
    return rank in ("", "0")


def current() -> Session | None:
    return _active


def deactivate_integrations() -> None:
    for integration in reversed(table.load()):
        integration.uninstall()
    REGISTRY.revert_all()


def deactivate() -> None:
    """Revert every patch and forget the session (for tests and embedding)."""
    global _active
    with _lock:
        deactivate_integrations()
        if _active is not None and _active.environment is not None:
            _active.environment.revert()
        _active = None
