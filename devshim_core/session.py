"""One activation per process: detect -> select -> build the device facade -> install the integrations."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from devshim_core.device import Device, build_device
from devshim_core.distributions import installed_version
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


_lock = threading.RLock()
_active: Session | None = None


def _install_integrations(session: Session) -> None:
    settings, device = session.settings, session.device
    if device.patches:
        plugin_set = PatchSet(name=f"plugin:{device.plugin}", requires=(), patches=device.patches,
                              reason=f"device gaps handled by the {device.plugin} plugin")
        REGISTRY.apply(plugin_set, device)
        session.integrations[plugin_set.name] = f"applied ({len(device.patches)} patches)"

    if device.type == "cuda" and not settings.cuda_facade:
        # DeepSpeed, Megatron, apex, TransformerEngine and flash-attn work natively here: change nothing
        session.integrations["devshim"] = (
            "stands aside: the device is CUDA, so DeepSpeed and Megatron run their own CUDA paths and nothing is "
            "redirected or blocked (DEVSHIM_CUDA_FACADE=1 routes DeepSpeed through devshim's facade)")
        return

    from devshim_core.integrations.torch_distributed import job_patch_sets

    if not settings.patch_distributed:
        session.integrations["distributed"] = "skipped: DEVSHIM_PATCH_DISTRIBUTED=0"
    elif not settings.shared_memory_collectives:
        session.integrations["torch.distributed-shared-memory"] = "skipped: DEVSHIM_SHARED_MEMORY_COLLECTIVES=0"
    for patch_set, summary in job_patch_sets(device, job_level=settings.patch_distributed,
                                             shared_memory_collectives=settings.shared_memory_collectives):
        REGISTRY.apply(patch_set, device)
        session.integrations[patch_set.name] = f"applied ({summary})"

    if device.type == "cuda":
        session.integrations["cuda-redirect"] = "skipped: the selected device is CUDA"
    elif not settings.redirect_cuda:
        session.integrations["cuda-redirect"] = "skipped: DEVSHIM_REDIRECT_CUDA=0"
    else:
        from devshim_core.integrations.cuda_redirect.patches import patch_set as redirect_patch_set

        applied = REGISTRY.apply(redirect_patch_set(device), device)
        session.integrations["cuda-redirect"] = f"applied ({applied.patch_set.reason})"

    if installed_version("deepspeed") is None or importlib.util.find_spec("deepspeed") is None:
        session.integrations["deepspeed"] = "skipped: deepspeed is not installed"
    elif not settings.patch_deepspeed:
        session.integrations["deepspeed"] = "skipped: DEVSHIM_PATCH_DEEPSPEED=0"
    else:
        from devshim_core.integrations.deepspeed.install import install

        session.integrations["deepspeed"] = install(device)

    if device.type == "cuda":
        session.integrations["megatron"] = "skipped: the device is CUDA, where Megatron runs its own CUDA paths"
    elif not settings.patch_megatron:
        session.integrations["megatron"] = "skipped: DEVSHIM_PATCH_MEGATRON=0"
    else:
        from devshim_core.integrations.megatron.install import install as install_megatron

        redirect_on = REGISTRY.is_applied("cuda-redirect")
        session.integrations["megatron"] = install_megatron(device, redirect_on)


def activate(environ: Mapping[str, str] | None = None, extra_plugins: Any = ()) -> Session:
    """Activate devshim in this process (idempotent: a second call returns the first session)."""
    global _active
    with _lock:
        if _active is not None:
            return _active
        settings = Settings.from_env(environ)
        if settings.emulate:  # the device must be up before the plugins look for it
            from devshim_core.emulation import bring_up

            bring_up(settings.emulate)
        registry = discover(settings, extra_plugins)
        selection = select(registry, settings)
        device = build_device(registry, selection)
        device.prepare_process()
        session = Session(settings, registry, selection, device)
        warning = selection.fallback_warning()
        if warning is not None:
            session.warnings.append(warning)
            if _is_rank_zero():
                print(warning, file=sys.stderr)
        try:
            _install_integrations(session)
        except BaseException:
            deactivate_integrations()
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
    from devshim_core.integrations.deepspeed.install import uninstall
    from devshim_core.integrations.megatron.install import uninstall as uninstall_megatron

    uninstall()
    uninstall_megatron()
    REGISTRY.revert_all()


def deactivate() -> None:
    """Revert every patch and forget the session (for tests and embedding)."""
    global _active
    with _lock:
        deactivate_integrations()
        _active = None
