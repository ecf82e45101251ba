"""A ``torch.cuda``-shaped module for the host CPU."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from devshim_core.errors import ConfigError

VISIBLE_DEVICES_ENV = "DEVSHIM_CPU_VISIBLE_DEVICES"


def _visible_count() -> int | None:
    """How many devices the visible-devices variable lists, or ``None`` when it is unset."""
    visible = os.environ.get(VISIBLE_DEVICES_ENV, "").strip()
    return len([v for v in visible.split(",") if v.strip()]) if visible else None


def configured_device_count() -> tuple[int, str]:
    """How many device slots the CPU offers, and where that number came from (``DEVSHIM_CPU_DEVICE_COUNT`` is the
    node's count; the visible-devices variable narrows what one process sees: :meth:`CpuDeviceModule.device_count`)."""
    raw = os.environ.get("DEVSHIM_CPU_DEVICE_COUNT", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ConfigError(f"DEVSHIM_CPU_DEVICE_COUNT={raw!r} must be a positive integer (ranks per host).")
        return int(raw), "DEVSHIM_CPU_DEVICE_COUNT"
    visible = _visible_count()
    if visible is not None:
        return visible, VISIBLE_DEVICES_ENV
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value), name
    return 1, "default; set DEVSHIM_CPU_DEVICE_COUNT for more ranks per host"


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK", "0")
    return int(value) if value.isdigit() else 0


class _HostGenerators(Sequence):
    """``default_generators`` of the CPU: every device index shares torch's one host generator."""

    def __init__(self, count: int) -> None:
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [torch.default_generator] * len(range(*index.indices(self._count)))
        return torch.default_generator


class CpuDeviceModule:
    """Device selection is bookkeeping (every rank uses the one host); RNG is torch's CPU generator.
    Streams and events come from devshim's host-side implementation (the traits say ``streams=False``)."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._current: int | None = None
        self.default_generators = _HostGenerators(count)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        # read at each call, as CUDA reads CUDA_VISIBLE_DEVICES lazily: the deepspeed launcher deletes the variable
        # (turning it into --include) and then sizes the node's pool with the full count
        visible = _visible_count()
        return self._count if visible is None else visible

    def current_device(self) -> int:
        return _local_rank() if self._current is None else self._current

    def set_device(self, device: Any) -> None:
        index = device.index if isinstance(device, torch.device) else device
        if index is not None:  # set_device("cpu") names no slot: the rank keeps its own
            self._current = int(index)

    def synchronize(self, device: Any = None) -> None:
        return None

    # the host generator itself, never torch.manual_seed: that calls torch.cuda.manual_seed_all, which the CUDA
    # redirect sends here, and would recurse
    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def initial_seed(self) -> int:
        return torch.default_generator.initial_seed()

    def seed(self) -> int:
        return torch.default_generator.seed()

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)
