"""Translate what a CUDA-written script names as a device into the selected device."""

from __future__ import annotations

from typing import Any

import torch

from devshim_core.device import Device


class DeviceMap:
    """``'cuda'``, ``'cuda:N'``, ``torch.device('cuda', N)`` and a bare index ``N`` -> the selected device.

    Anything else (``'cpu'``, ``'meta'``, the device's own name, ``None``) passes through unchanged. Answers
    are memoised per spec: scripts name a handful of devices millions of times.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.type = device.type
        self.memo: dict[Any, Any] = {}  # read directly by the native wrappers

    def __call__(self, spec: Any) -> Any:
        try:
            return self.memo[spec]
        except KeyError:
            pass
        except TypeError:  # unhashable: not a device spec torch would accept anyway
            return spec
        mapped = self._translate(spec)
        if len(self.memo) < 4096:  # bound: an f-string per step must not grow it forever
            self.memo[spec] = mapped
        return mapped

    def _translate(self, spec: Any) -> Any:
        kind = type(spec)
        if kind is int:  # torch reads a bare index as a CUDA ordinal
            return self.device.torch_device(spec)
        if kind is str:
            if not spec.startswith("cuda"):
                return spec
            try:
                spec = torch.device(spec)
            except RuntimeError:
                return spec  # torch will raise its own error for a malformed string
            kind = torch.device
        if kind is torch.device and spec.type == "cuda":
            return self.device.torch_device(spec.index)
        return spec

    def index(self, spec: Any) -> int:
        """The device index a ``torch.cuda.*`` argument names (``None``/``'cuda'`` = the current device)."""
        if spec is None:
            return self.device.current_device()
        if type(spec) is int:
            return spec
        if isinstance(spec, str):
            spec = torch.device(spec)
        if isinstance(spec, torch.device):
            return self.device.current_device() if spec.index is None else spec.index
        return int(spec)

    def device_type(self, name: Any) -> Any:
        """``device_type='cuda'`` (autocast, GradScaler) -> the selected device's type."""
        if isinstance(name, torch.device):
            name = name.type
        return self.type if name == "cuda" else name
