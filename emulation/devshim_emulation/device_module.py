"""The ``torch.<name>`` module of an emulated device: ``torch.cuda``'s names, on the compiled emulator.

A vendor SDK registers a module like this one as ``torch.npu`` / ``torch.tpu``; the simulated SDKs register
this one. Streams and events are torch's generic ``torch.Stream`` / ``torch.Event`` on the emulator's
device guard: stream identity, the current stream and event timing are real; kernels run when called, and
copies issued on a side stream land only when something waits for that stream.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch

from devshim_core.stream_context import StreamContext
from devshim_emulation.device import DEVICE_MEMORY


class DeviceProperties(NamedTuple):
    name: str
    total_memory: int
    multi_processor_count: int = 1
    major: int = 0
    minor: int = 0


def _index(device: Any, default: int) -> int:
    if device is None:
        return default
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return default if device.index is None else device.index
    raise TypeError(f"expected a device index, a device string or a torch.device, got {device!r}")


class _Generators(Sequence):
    def __init__(self, extension: ModuleType) -> None:
        self._extension = extension

    def __len__(self) -> int:
        return self._extension.device_count()

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(f"device index {index} out of range (0..{len(self) - 1})")
        return self._extension.default_generator(index)


FAULTY_DEVICES_ENV = "DEVSHIM_EMULATE_FAULTY_DEVICES"


def _faulty_devices() -> frozenset[int]:
    """Device indices whose set-up fails in this process (``DEVSHIM_EMULATE_FAULTY_DEVICES=1,3``): for testing
    how a job fails when one rank's device is broken."""
    raw = os.environ.get(FAULTY_DEVICES_ENV, "")
    parts = [part.strip() for part in raw.split(",") if part.strip()]
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"{FAULTY_DEVICES_ENV}={raw!r} must be a comma-separated list of device indices")
    return frozenset(int(part) for part in parts)


class EmulatedDeviceModule(ModuleType):
    """``torch.<name>`` for the emulated device ``name``."""

    def __init__(self, name: str, extension: ModuleType, device_name: str, bf16: bool = True,
                 recount: Callable[[], int] | None = None) -> None:
        super().__init__(f"torch.{name}")
        self.type = name
        self._ext = extension
        self._recount = recount  # counts the visible devices again until the first set_device
        self._device_name = device_name
        self._bf16 = bf16
        self._memory_fraction: dict[int, float] = {}
        self._faulty = _faulty_devices()
        self.default_generators = _Generators(extension)
        module = self

        class Stream(torch.Stream):
            """A stream of the emulated device (``torch.Stream`` on its device guard)."""

            def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
                index = _index(device, module.current_device())
                return super().__new__(cls, device=torch.device(name, index), priority=priority, **kwargs)

        def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                  **kwargs: Any) -> torch.Event:
            """An event of the emulated device (``torch.Event``); ``elapsed_time`` is host time between records."""
            return torch.Event(device=torch.device(name, module.current_device()), enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)

        class device:
            """Context manager that makes ``index`` the current device, as ``torch.cuda.device``."""

            def __init__(self, index: Any) -> None:
                self.index = _index(index, -1)
                self.previous = -1

            def __enter__(self) -> None:
                self.previous = module.current_device()
                if self.index >= 0:
                    module.set_device(self.index)

            def __exit__(self, *exc: Any) -> None:
                module.set_device(self.previous)

        self.Stream, self.Event, self.device = Stream, Event, device

    # -- device ---------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return self._ext.device_count() > 0

    def is_initialized(self) -> bool:
        return True

    def _lazy_init(self) -> None:
        return None

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        if self._recount is not None:
            count = self._recount()
            if count != self._ext.device_count():
                self._ext.configure(count, DEVICE_MEMORY)
        return self._ext.device_count()

    def current_device(self) -> int:
        return self._ext.current_device()

    def set_device(self, device: Any) -> None:
        self.device_count()
        self._recount = None  # the runtime is initialized now: its device count is fixed
        index = _index(device, -1)
        if index in self._faulty:  # as a vendor runtime fails to open a broken or busy device
            raise RuntimeError(f"{self.type} runtime: initializing device {index} failed (emulated fault: "
                               f"{FAULTY_DEVICES_ENV}={os.environ.get(FAULTY_DEVICES_ENV, '')!r})")
        if index >= 0:  # set_device("npu") names no index: keep the current one, as torch.cuda does
            self._ext.set_device(index)

    def synchronize(self, device: Any = None) -> None:
        """Wait for the device: kernels have finished already; copies queued on its side streams land now."""
        self._ext.synchronize(_index(device, self.current_device()))

    def get_device_name(self, device: Any = None) -> str:
        return self._device_name

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        return (0, 0)

    def get_device_properties(self, device: Any = None) -> DeviceProperties:
        index = _index(device, self.current_device())
        return DeviceProperties(name=self._device_name, total_memory=self._ext.memory_info(index)[1])

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return tuple(self._ext.memory_info(_index(device, self.current_device())))

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return self._bf16

    def get_amp_supported_dtype(self) -> list[torch.dtype]:  # torch.autocast asks the backend module this
        return [torch.float16, torch.bfloat16] if self._bf16 else [torch.float16]

    # -- streams ----------------------------------------------------------------------------------
    def current_stream(self, device: Any = None) -> Any:
        return torch.accelerator.current_stream(torch.device(self.type, _index(device, self.current_device())))

    def default_stream(self, device: Any = None) -> Any:
        current = self.current_stream(device)
        return torch.Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)

    def set_stream(self, stream: Any) -> None:
        if stream is not None:
            torch.accelerator.set_stream(stream)

    def stream(self, stream: Any) -> StreamContext:
        """``torch.npu.stream(s)``/``torch.tpu.stream(s)``: like the vendors' (and torch's) StreamContext, a
        context that can be entered again."""
        return StreamContext(self._stream_block, stream)

    @contextlib.contextmanager
    def _stream_block(self, stream: Any) -> Iterator[Any]:
        """Make ``stream`` current for the block, as ``torch.cuda.stream``: setting a stream of another device
        also makes that device current, so on exit both the streams and the current device are restored."""
        if stream is None:
            yield None
            return
        device = self.current_device()
        previous_there = self.current_stream(stream.device)
        previous_here = self.current_stream(device)
        torch.accelerator.set_stream(stream)
        try:
            yield stream
        finally:
            torch.accelerator.set_stream(previous_there)
            torch.accelerator.set_stream(previous_here)  # a stream of the device that was current: back on it
            self.set_device(device)

    # -- RNG ----------------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self.default_generators[self.current_device()].manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        for generator in self.default_generators:
            generator.manual_seed(int(seed))

    def seed(self) -> None:
        self.default_generators[self.current_device()].seed()

    def seed_all(self) -> None:
        for generator in self.default_generators:
            generator.seed()

    def initial_seed(self) -> int:
        return self.default_generators[self.current_device()].initial_seed()

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return self.default_generators[_index(device, self.current_device())].get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
        self.default_generators[_index(device, self.current_device())].set_state(new_state.cpu())

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [g.get_state() for g in self.default_generators]

    def set_rng_state_all(self, states: Sequence[torch.Tensor]) -> None:
        for generator, state in zip(self.default_generators, states, strict=True):
            generator.set_state(state.cpu())

    # -- memory ---------------------------------------------------------------------------------------
    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return dict(self._ext.memory_stats(_index(device, self.current_device())))

    def memory_allocated(self, device: Any = None) -> int:
        return self.memory_stats(device)["allocated_bytes.all.current"]

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.memory_stats(device)["allocated_bytes.all.peak"]

    def memory_reserved(self, device: Any = None) -> int:
        return self.memory_stats(device)["reserved_bytes.all.current"]

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.memory_stats(device)["reserved_bytes.all.peak"]

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._ext.reset_peak_stats(_index(device, self.current_device()))

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        self._ext.reset_accumulated_stats(_index(device, self.current_device()))

    def empty_cache(self) -> None:
        return None  # the emulator caches nothing: freed blocks go straight back to the host

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be within [0, 1], got {fraction}")
        self._memory_fraction[_index(device, self.current_device())] = fraction

    # -- emulator introspection (not part of a vendor API) ------------------------------------------
    def pending_copies(self) -> int:
        """Copies issued on side streams that no wait has published yet (all devices)."""
        return self._ext.pending_copies()

    def fallback_calls(self) -> int:
        """How many ops ran on CPU kernels through the fallback so far (all of them but the structural ones)."""
        return self._ext.fallback_calls()

    def pinned_bytes(self) -> int:
        return self._ext.pinned_bytes()
