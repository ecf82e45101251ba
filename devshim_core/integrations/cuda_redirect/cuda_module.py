"""``torch.cuda``'s functions, answered by the selected device's facade."""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from devshim_core import migration_log
from devshim_core.device import Device
from devshim_core.errors import DevshimError
from devshim_core.integrations.cuda_redirect import coverage
from devshim_core.integrations.cuda_redirect.device_map import DeviceMap


class _DeviceContext:
    """``torch.cuda.device(i)``: make ``i`` current inside the block, restore the previous one after. A class, as
    CUDA's is: torch asks ``isinstance(x, torch.cuda.device)`` (``torch.cuda._utils._get_device_index``, which
    ``torch.load`` reaches). ``None`` and a negative index select nothing, as in CUDA."""

    _facade: Device
    _devices: DeviceMap

    def __init__(self, device: Any) -> None:
        no_op = device is None or (type(device) is int and device < 0)
        self.idx = -1 if no_op else self._devices.index(device)  # CUDA's attribute names
        self.prev_idx = -1

    def __enter__(self) -> _DeviceContext:
        if self.idx >= 0:
            self.prev_idx = self._facade.current_device()
            self._facade.set_device(self.idx)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.prev_idx >= 0:
            self._facade.set_device(self.prev_idx)
            self.prev_idx = -1


def device_class(d: Device, devices: DeviceMap) -> type:
    """``torch.cuda.device`` on ``d``: a class of its own per facade."""
    return type("device", (_DeviceContext,), {"_facade": d, "_devices": devices, "__module__": "torch.cuda",
                                              "__qualname__": "device", "__doc__": _DeviceContext.__doc__})


class _MadeBy(type):
    """The metaclass of :func:`as_class`'s classes: an instance is anything the factory has made."""

    made: set[type]

    def __instancecheck__(cls, instance: Any) -> bool:
        return type(instance) in cls.made


def as_class(name: str, factory: Any) -> type:
    """``factory`` if it is a class, else a class standing for it. torch's own code asks
    ``isinstance(x, torch.cuda.Event)`` (``torch._jit_internal``'s tensor extraction, run by every DDP
    all-reduce future), which raises if ``torch.cuda.Event`` is a plain function, as a vendor's may be."""
    if isinstance(factory, type):
        return factory

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        made = factory(*args, **kwargs)
        cls.made.add(type(made))  # type: ignore[attr-defined]  # the set in the class dict below
        return made

    return _MadeBy(name, (), {"__new__": __new__, "made": set(), "__doc__": getattr(factory, "__doc__", None),
                              "__module__": "torch.cuda"})


def _properties(d: Device, devices: DeviceMap) -> Callable[..., Any]:
    module_properties = getattr(d.module, "get_device_properties", None)

    def get_device_properties(device: Any = None) -> Any:
        index = devices.index(device)
        base = module_properties(index) if module_properties is not None else None
        # CUDA's field names; torch's compile cache reads gcnArchName when torch.version.cuda is None
        return SimpleNamespace(
            name=getattr(base, "name", d.traits.name or d.type),
            total_memory=getattr(base, "total_memory", None) or d.total_memory(index),
            major=0, minor=0, multi_processor_count=getattr(base, "multi_processor_count", os.cpu_count() or 1),
            gcnArchName="", warp_size=1, is_integrated=0, is_multi_gpu_board=0, L2_cache_size=0,
            uuid=f"{d.type}-{index}", max_threads_per_multi_processor=1, regs_per_multiprocessor=0)

    return get_device_properties


def _utilization(d: Device, devices: DeviceMap) -> Callable[..., Any]:
    """The vendor module's ``utilization`` where it has one (torch_npu's); refused by name where it has none."""
    vendor = getattr(d.module, "utilization", None)

    def utilization(device: Any = None) -> Any:
        if vendor is None:
            raise DevshimError(
                f"torch.cuda.utilization() has no answer on {d.type} (devshim plugin {d.plugin}): CUDA reads it from "
                f"NVML, and the {d.plugin} plugin's device module reports no utilization. Remove the call, or read "
                "the device's own monitoring tool.")
        return vendor(devices.index(device))

    return utilization


def replacements(d: Device, devices: DeviceMap) -> dict[str, Any]:
    """``torch.cuda`` name -> its answer on ``d`` (every name of ``coverage.DEVICE_FUNCTIONS``)."""
    index = devices.index
    module = d.module

    def set_device(device: Any) -> None:
        if not (type(device) is int and device < 0):  # torch.cuda.set_device(-1) is a no-op
            d.set_device(index(device))

    # the default, 'cuda' (the current device), is the device module's own default: a training loop that saves the
    # RNG state every step pays no device lookup for it (bench/cuda_redirect.py times the call)
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        if device == "cuda" and type(device) is str:
            return d.get_rng_state()
        return d.get_rng_state(d.torch_device(index(device)))

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        if device == "cuda" and type(device) is str:
            d.set_rng_state(new_state)
        else:
            d.set_rng_state(new_state, d.torch_device(index(device)))

    seed = getattr(module, "seed", None) or (lambda: d.manual_seed(random.getrandbits(63)))
    seed_all = getattr(module, "seed_all", None) or (lambda: d.manual_seed_all(random.getrandbits(63)))

    def on(device: Any) -> Any:
        return None if device is None else d.torch_device(index(device))

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        i = index(device)
        return d.available_memory(i), d.total_memory(i)

    def by_index(function: Callable[..., Any]) -> Callable[..., Any]:
        # torch.cuda's memory functions take the device alone. None is passed on: the allocator's callables take an
        # optional index, None the current device, like torch.cuda's (AllocatorSpec), so memory_allocated() pays no
        # current-device lookup
        def call(device: Any = None) -> Any:
            return function(None if device is None else index(device))

        call.__name__ = call.__qualname__ = getattr(function, "__name__", "call")
        return call

    set_stream = getattr(module, "set_stream", None)
    if set_stream is None:
        # no setter: entering the stream context is the only way. The entered context must stay referenced:
        # a dropped one is closed by the garbage collector, which restores the previous stream at once
        entered = threading.local()

        def set_stream(stream: Any) -> None:
            if stream is None:  # torch.cuda.set_stream(None) is a no-op
                return
            held = getattr(entered, "context", None)
            if held is not None:  # leave the previous set_stream first: its exit restores what it replaced
                held.__exit__(None, None, None)
            entered.context = d.stream(stream)
            entered.context.__enter__()

    answers: dict[str, Any] = {
        "is_available": d.is_available,
        "device_count": d.device_count,
        "current_device": d.current_device,
        "set_device": set_device,
        "synchronize": lambda device=None: d.synchronize(),
        "manual_seed": d.manual_seed,
        "manual_seed_all": d.manual_seed_all,
        "seed": seed,
        "seed_all": seed_all,
        "initial_seed": d.initial_seed,
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [get_rng_state(i) for i in range(d.device_count())],
        "set_rng_state_all": lambda new_states: [set_rng_state(s, i) for i, s in enumerate(new_states)] and None,  # type: ignore[func-returns-value]  # the list only makes the calls
        "Stream": as_class("Stream", d.Stream),  # both stream kinds read the index of a 'cuda:N' they are given
        "Event": as_class("Event", d.Event),
        "stream": d.stream,
        "current_stream": lambda device=None: d.current_stream(on(device)),
        "default_stream": lambda device=None: d.default_stream(on(device)),
        "set_stream": set_stream,
        "memory_allocated": by_index(d.memory_allocated),
        "max_memory_allocated": by_index(d.max_memory_allocated),
        "memory_reserved": by_index(d.memory_reserved),
        "max_memory_reserved": by_index(d.max_memory_reserved),
        "memory_cached": by_index(d.memory_reserved),
        "max_memory_cached": by_index(d.max_memory_reserved),
        "reset_peak_memory_stats": by_index(d.reset_peak_memory_stats),
        "reset_max_memory_allocated": by_index(d.reset_peak_memory_stats),
        "reset_max_memory_cached": by_index(d.reset_peak_memory_stats),
        "memory_stats": by_index(d.memory_stats),
        "empty_cache": d.empty_cache,
        "mem_get_info": mem_get_info,
        "get_device_name": lambda device=None: d.traits.name or d.type,
        "get_device_properties": _properties(d, devices),
        "get_device_capability": lambda device=None: (0, 0),  # no CUDA architecture: arch-gated CUDA paths stay off
        "is_bf16_supported": lambda including_emulation=True: d.traits.bf16_supported,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "is_current_stream_capturing": lambda: False,  # nothing is ever captured: graphs are not served
        "ipc_collect": lambda: None,
        "device": device_class(d, devices),
        "utilization": _utilization(d, devices),
        "default_generators": getattr(module, "default_generators", None) or (torch.default_generator,),
        # internals: CUDA defers seeding until it is initialised; a device without CUDA must run them now,
        # or the seeds (Megatron's tensor-parallel RNG tracker) are queued forever and silently lost
        "_lazy_init": lambda: None,
        "_lazy_call": lambda callable, **kwargs: callable(),
    }
    log = migration_log.recorder()
    if log is not None:
        answers.update({n: _recorded(log, n, a) for n, a in answers.items()
                        if not n.startswith("_") and callable(a) and not isinstance(a, type)})
    return answers


def _recorded(log: migration_log.Recorder, name: str, answer: Callable[..., Any]) -> Callable[..., Any]:
    """``answer``, recording its caller: ``modified`` where CUDA would answer otherwise (``coverage.MODIFIED``).
    Classes (``Stream``, ``Event``, ``device``) are left unwrapped: ``isinstance`` must keep working."""
    call = f"torch.cuda.{name}"
    tag, did = ("modified", coverage.MODIFIED[name]) if name in coverage.MODIFIED else ("served", "answered by the "
                                                                                         "device facade")

    def recorded(*args: Any, **kwargs: Any) -> Any:
        log.call(call, tag, "{}", did)
        return answer(*args, **kwargs)

    recorded.__name__ = recorded.__qualname__ = name
    recorded.__wrapped__ = answer  # type: ignore[attr-defined]  # what functools.wraps would set
    return recorded


class _NvtxRanges:
    """``torch.cuda.nvtx`` as ``torch.profiler.record_function`` ranges: named in a trace, no CUDA needed."""

    def __init__(self) -> None:
        self._open: list[Any] = []

    def range_push(self, msg: str) -> int:
        scope = torch.autograd.profiler.record_function(msg)
        scope.__enter__()
        self._open.append(scope)
        return len(self._open) - 1

    def range_pop(self) -> int:
        if not self._open:
            return -1
        self._open.pop().__exit__(None, None, None)
        return len(self._open)

    def mark(self, msg: str) -> None:
        with torch.autograd.profiler.record_function(msg):
            pass

    def range(self, msg: str, *args: Any, **kwargs: Any) -> Any:
        return torch.autograd.profiler.record_function(msg.format(*args, **kwargs))


def nvtx_replacements() -> dict[str, Any]:
    ranges = _NvtxRanges()
    return {"range_push": ranges.range_push, "range_pop": ranges.range_pop, "mark": ranges.mark,
            "range": ranges.range}


class CudaCallRefused(DevshimError):
    """A ``torch.cuda`` call the redirect cannot serve on the selected device (``coverage.refused_names``)."""


def _refusal(d: Device, name: str, why: str) -> CudaCallRefused:
    return CudaCallRefused(f"torch.cuda.{name}() cannot run on {d.type} (devshim plugin {d.plugin}, CUDA redirect): "
                           f"{why}. `devshim check SCRIPT` lists every such call.")


def refuser(d: Device, name: str, why: str, original: Any) -> Any:
    """What stands for ``torch.cuda.<name>`` (``original``) under the redirect: it raises, naming the call. A class
    stays a class (``isinstance(x, torch.cuda.CUDAGraph)`` keeps working: nothing is one), a function keeps the
    original's signature for introspection."""
    log, call = migration_log.recorder(), f"torch.cuda.{name}"
    if isinstance(original, type):
        def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
            if log is not None:
                log.call(call, "refused", "{}", why)
            raise _refusal(d, name, why)

        return type(name, (), {"__new__": __new__, "__module__": "torch.cuda", "__qualname__": name,
                               "__doc__": f"Refused by devshim's CUDA redirect: {why}."})

    def refused(*args: Any, **kwargs: Any) -> Any:
        if log is not None:
            log.call(call, "refused", "{}", why)
        raise _refusal(d, name, why)

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = "torch.cuda"
    refused.__doc__ = f"Refused by devshim's CUDA redirect: {why}."
    refused.__devshim_original__ = original  # type: ignore[attr-defined]  # as every devshim wrapper records it
    with contextlib.suppress(TypeError, ValueError):  # builtins without a signature keep (*args, **kwargs)
        refused.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    return refused


def refusers(d: Device, originals: dict[str, Any]) -> dict[str, Any]:
    """``torch.cuda`` name -> its refuser, for the refused names this torch has (``originals``)."""
    why = coverage.refused_names()
    return {n: refuser(d, n, why[n], o) for n, o in originals.items() if o is not None and callable(o)}
