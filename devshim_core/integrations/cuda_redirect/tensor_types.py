"""``torch.cuda.FloatTensor`` and friends, and the names ``Tensor.type()`` reports, on the selected device.

Megatron's distributed optimizer accepts only parameters whose ``type()`` is ``torch.cuda.FloatTensor``,
``HalfTensor`` or ``BFloat16Tensor``; a tensor on the selected device reports those names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from devshim_core.integrations.cuda_redirect.coverage import TENSOR_TYPES
from devshim_core.integrations.cuda_redirect.device_map import DeviceMap

_DTYPES = {name: getattr(torch, dtype) for name, dtype in TENSOR_TYPES.items()}
_CUDA_NAMES = {dtype: f"torch.cuda.{name}" for name, dtype in _DTYPES.items()}


class _TypedTensorMeta(type):
    """``isinstance(x, torch.cuda.FloatTensor)``: a float32 tensor on the selected device."""

    dtype: torch.dtype
    device_type: str

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and obj.dtype == cls.dtype and obj.device.type == cls.device_type


def typed_tensor_classes(devices: DeviceMap) -> dict[str, type]:
    """One class per legacy CUDA type name; calling it builds the tensor as the CPU legacy type does, there."""
    classes: dict[str, type] = {}
    for name, dtype in _DTYPES.items():
        legacy = getattr(torch, name)  # torch.FloatTensor: the same constructor, on the host

        def new(cls: type, *args: Any, _legacy: Any = legacy, **kwargs: Any) -> torch.Tensor:
            device = kwargs.pop("device", None)
            target = devices.device.torch_device(devices.index(device))
            return _legacy(*args, **kwargs).to(target)

        classes[name] = _TypedTensorMeta(name, (), {"__new__": new, "dtype": dtype, "device_type": devices.type,
                                                    "__module__": "torch.cuda", "is_cuda": True})
    return classes


def tensor_type(original: Callable[..., Any], devices: DeviceMap, classes: dict[str, type]) -> Callable[..., Any]:
    """``Tensor.type``: CUDA's names for tensors on the selected device; ``'torch.cuda.X'`` converts there."""
    device_type = devices.type
    by_name = {f"torch.cuda.{name}": cls for name, cls in classes.items()}

    def type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            if self.device.type == device_type:
                return _CUDA_NAMES.get(self.dtype) or original(self)
            return original(self)
        cls: Any = by_name.get(dtype) if isinstance(dtype, str) else (dtype if dtype in classes.values() else None)
        if cls is not None:
            # as CUDA's Tensor.type: a tensor already on the device keeps its index, others go to the current one
            target = self.device if self.device.type == device_type else devices.device.torch_device(
                devices.device.current_device())
            return self.to(device=target, dtype=cls.dtype, non_blocking=non_blocking)
        return original(self, dtype, non_blocking, **kwargs)

    return type
