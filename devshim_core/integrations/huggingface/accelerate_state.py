"""Accelerate's device choice, where it took CUDA for the selected device.

``PartialState._prepare_backend`` picks ``nccl`` and ``MULTI_GPU`` when ``torch.cuda.is_available()``; ``set_device``
and ``default_device`` then name ``cuda:N``. Each wrapper keeps Accelerate's decision and renames what it chose:
the device's own backend (a backend the caller named is kept: the redirect serves ``nccl``), the selected device at
the same index, and on the host CPU Accelerate's ``MULTI_CPU``, whose DDP takes no ``device_ids`` (with them, DDP
refuses a CPU module). A device Accelerate knows itself (``npu``: ``MULTI_NPU``, ``hccl``) never reaches CUDA here.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch

from devshim_core.device import Device
from devshim_core.integrations.cuda_redirect.device_map import DeviceMap

# set while Accelerator.__init__ runs: its mixed-precision set-up then reads the device as CUDA (below)
_IN_ACCELERATOR_INIT: contextvars.ContextVar[bool] = contextvars.ContextVar("devshim_accelerator_init", default=False)
# in Accelerate's shared state (PartialState is a Borg: an attribute set on one is set on all; a reset clears it):
# Accelerate took CUDA for the device and devshim renamed it. A device Accelerate chose itself (its npu path, the CPU
# a user asked for with cpu=True) is never marked, and its set-up stays Accelerate's own
TOOK_CUDA = "_devshim_took_cuda"


def _renamed(state: Any) -> None:
    setattr(state, TOOK_CUDA, True)


def _took_cuda() -> bool:
    from accelerate.state import PartialState

    return bool(PartialState._shared_state.get(TOOK_CUDA, False))


def selected(device: Device, chosen: torch.device) -> torch.device:
    """Accelerate's ``cuda[:N]`` as the selected device, by the redirect's own rule; any other device unchanged."""
    return DeviceMap(device)(chosen)


def prepare_backend(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                         backend: str | None = None) -> tuple[str | None, Any]:
        from accelerate.utils import DistributedType

        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if distributed_type != DistributedType.MULTI_GPU or sagemaker_dp:
            return chosen, distributed_type
        _renamed(self)
        if backend is None:  # Accelerate's own pick, nccl; a backend the caller named must stay (it compares)
            chosen = device.collectives.backend
        if device.type == "cpu":
            distributed_type = DistributedType.MULTI_CPU
        return chosen, distributed_type

    _prepare_backend.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    return _prepare_backend


def set_device(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def set_device(self: Any) -> None:
        original(self)  # torch.cuda.set_device(cuda:N) is served by the redirect
        if self.device is not None and self.device.type == "cuda":
            _renamed(self)
            self.device = selected(device, self.device)

    set_device.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    return set_device


def default_device(original: property, device: Device) -> property:
    def default_device(self: Any) -> torch.device:
        assert original.fget is not None
        chosen = original.fget(self)
        if chosen.type == "cuda":
            _renamed(self)
        return selected(device, chosen)

    default_device.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    return property(default_device, doc=original.__doc__)


def accelerator_init(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        token = _IN_ACCELERATOR_INIT.set(True)
        try:
            original(self, *args, **kwargs)
        finally:
            _IN_ACCELERATOR_INIT.reset(token)

    __init__.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    return __init__


def accelerator_device(original: property, device: Device) -> property:
    """``Accelerator.device``: the state's device, except while ``__init__`` runs on a device Accelerate took CUDA
    for, when it reads as ``cuda``. Its mixed-precision set-up accepts only device types it lists (fp16 raises for
    ``tpu``) and ignores fp16 on ``cpu``; CUDA's set-up (``GradScaler('cuda')``) is what the redirect serves on any
    device, as it did when Accelerate took CUDA for the device. Autocast is entered later, on the device's own
    type."""

    def get(self: Any) -> torch.device:
        assert original.fget is not None
        chosen = original.fget(self)
        if (_IN_ACCELERATOR_INIT.get() and isinstance(chosen, torch.device) and chosen.type == device.type
                and _took_cuda()):
            index = chosen.index if chosen.index is not None else 0
            return torch.device("cuda", index)
        return chosen

    get.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    return property(get, doc=original.__doc__)
