"""DeepSpeed's accelerator interface, implemented entirely on the device facade.

This module is imported while ``deepspeed`` itself is still initialising (right after
``deepspeed.accelerator.real_accelerator`` runs), so it imports nothing else from DeepSpeed at module
level. Plain pass-throughs are bound as instance attributes in ``__init__`` (no second dispatch);
the methods below define the contract and serve the few calls that need adapting.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from typing import Any

import torch
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

from devshim_core.device import Device
from devshim_core.errors import DevshimError

OP_BUILDER_PACKAGE = "devshim_core.integrations.deepspeed.op_builders"
# Ops DeepSpeed builds that devshim deliberately answers with "none": collectives go to the backend.
_NO_BUILDER = frozenset({"ShareMemCommBuilder", "CCLCommBuilder"})
_TENSOR_TYPES = {
    "BFloat16Tensor": torch.bfloat16,
    "ByteTensor": torch.uint8,
    "DoubleTensor": torch.float64,
    "FloatTensor": torch.float32,
    "HalfTensor": torch.float16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
}


class _TensorType:
    """``accelerator.FloatTensor(...)`` for devices without legacy tensor-type classes."""

    def __init__(self, dtype: torch.dtype, device: Device) -> None:
        self.dtype, self._device = dtype, device

    def __call__(self, *args: Any) -> torch.Tensor:
        target = self._device.torch_device(self._device.current_device())
        if len(args) == 1 and not isinstance(args[0], int):
            return torch.as_tensor(args[0], dtype=self.dtype, device=target)
        return torch.empty(*args, dtype=self.dtype, device=target)


class DevshimAccelerator(DeepSpeedAccelerator):
    """A DeepSpeed accelerator for whichever device devshim selected."""

    def __init__(self, device: Device) -> None:
        super().__init__()
        self._devshim_device = device
        self._name = device.type
        self._communication_backend_name = device.collectives.backend
        self._compile_backend = "inductor"
        self._class_dict: dict[str, type] | None = None
        self._ranges: list[Any] = []
        self._torch_pins_host_memory = device.traits.pin_memory
        # direct bindings: DeepSpeed's call lands on the plugin's function
        for name in ("set_device", "current_device", "device_count", "synchronize", "manual_seed",
                     "manual_seed_all", "initial_seed", "current_stream", "default_stream", "stream", "is_available",
                     "empty_cache", "memory_allocated", "max_memory_allocated", "memory_stats",
                     "reset_peak_memory_stats", "memory_reserved", "max_memory_reserved", "total_memory",
                     "available_memory"):
            setattr(self, name, getattr(device, name))
        # bound over the methods below like those of the loop: DeepSpeed's call lands on the plugin's function
        self.memory_cached = device.memory_reserved  # type: ignore[method-assign]  # bound as above
        self.max_memory_cached = device.max_memory_reserved  # type: ignore[method-assign]  # bound as above

    # -- execution model ----------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return self._devshim_device.traits.host_synchronous

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # -- device -------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._devshim_device.device_name(device_index)

    def device(self, device_index: int | None = None) -> torch.device:
        return self._devshim_device.torch_device(device_index)

    def set_device(self, device_index: int) -> None:
        self._devshim_device.set_device(device_index)

    def current_device(self) -> int:
        return self._devshim_device.current_device()

    def current_device_name(self) -> str:
        return self._devshim_device.device_name(self._devshim_device.current_device())

    def device_count(self) -> int:
        return self._devshim_device.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        self._devshim_device.synchronize(device_index)

    # -- RNG ----------------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            self._devshim_device.set_rng_state(new_state)
        else:
            self._devshim_device.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if device_index is None:
            return self._devshim_device.get_rng_state()
        return self._devshim_device.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        self._devshim_device.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._devshim_device.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return self._devshim_device.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        generators = getattr(self._devshim_device.module, "default_generators", None)
        if generators is None:
            return torch.default_generator
        return generators[device_index]

    # -- streams and events -------------------------------------------------------------------
    @property
    def Stream(self) -> Any:
        return self._devshim_device.Stream

    def stream(self, stream: Any) -> Any:
        return self._devshim_device.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._devshim_device.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._devshim_device.default_stream(device_index)

    @property
    def Event(self) -> Any:
        return self._devshim_device.Event

    # -- memory -------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        self._devshim_device.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._devshim_device.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._devshim_device.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._devshim_device.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        return self._devshim_device.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self._devshim_device.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self._devshim_device.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> Any:
        return self._devshim_device.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._devshim_device.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._devshim_device.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._devshim_device.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return self._devshim_device.total_memory(device_index)

    def available_memory(self, device_index: int | None = None) -> int:
        return self._devshim_device.available_memory(device_index)

    # -- dtypes -------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return self._devshim_device.traits.bf16_supported

    def is_fp16_supported(self) -> bool:
        return self._devshim_device.traits.fp16_supported

    def is_fp64_supported(self) -> bool:
        return self._devshim_device.traits.fp64_supported

    def supported_dtypes(self) -> list[torch.dtype]:
        return list(self._devshim_device.traits.supported_dtypes)

    # -- misc ---------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return self._devshim_device.is_available()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        # DeepSpeed brackets many hot functions with ranges: record them only while a profiler listens
        scope = None
        if torch.autograd._profiler_enabled():
            scope = torch.autograd.profiler.record_function(msg)
            scope.__enter__()
        self._ranges.append(scope)

    def range_pop(self, domain: Any = None) -> None:
        if self._ranges:
            scope = self._ranges.pop()
            if scope is not None:
                scope.__exit__(None, None, None)

    def lazy_call(self, callback: Any) -> Any:
        # devshim's device is initialised when it is selected, so nothing needs deferring
        return callback()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False

    # -- graphs: refused. A graph that captures nothing replays nothing: DeepSpeed's inference engine would
    # return its first call's outputs for every later input (DeepSpeed's own CPU accelerator does that) ------
    def _no_graphs(self) -> DevshimError:
        return DevshimError(
            f"DeepSpeed asked for a device graph (CUDA-graph capture), which devshim does not offer on "
            f"{self._name}: a graph that captured nothing would replay nothing and return stale outputs. Turn "
            "the option off: init_inference(enable_cuda_graph=False), or hybrid_engine.enable_cuda_graph false.")

    def create_graph(self) -> Any:
        raise self._no_graphs()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        raise self._no_graphs()

    def replay_graph(self, graph: Any) -> None:
        raise self._no_graphs()

    # -- legacy tensor types ------------------------------------------------------------------
    def _tensor_type(self, name: str) -> Any:
        legacy = getattr(self._devshim_device.module, name, None)
        if legacy is not None:
            return legacy
        if self._name == "cpu":
            return getattr(torch, name)
        dtype = _TENSOR_TYPES[name]
        if dtype == torch.int64 and not self._devshim_device.traits.int64_supported:
            dtype = torch.int32  # a device without int64 narrows it, as its vendor's own LongTensor does
        return _TensorType(dtype, self._devshim_device)

    @property
    def BFloat16Tensor(self) -> Any:
        return self._tensor_type("BFloat16Tensor")

    @property
    def ByteTensor(self) -> Any:
        return self._tensor_type("ByteTensor")

    @property
    def DoubleTensor(self) -> Any:
        return self._tensor_type("DoubleTensor")

    @property
    def FloatTensor(self) -> Any:
        return self._tensor_type("FloatTensor")

    @property
    def HalfTensor(self) -> Any:
        return self._tensor_type("HalfTensor")

    @property
    def IntTensor(self) -> Any:
        return self._tensor_type("IntTensor")

    @property
    def LongTensor(self) -> Any:
        return self._tensor_type("LongTensor")

    # -- host memory pinning ------------------------------------------------------------------
    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self._torch_pins_host_memory else tensor

    def _torch_empty_pinned(self, tensor: torch.Tensor, shape: Any) -> torch.Tensor:
        return tensor.new_empty(shape, pin_memory=self._torch_pins_host_memory)

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._torch_pins_host_memory else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- op builders: plugin kernels behind DeepSpeed's builder API, never compiled -------------
    def op_builder_dir(self) -> str:
        return OP_BUILDER_PACKAGE

    def _builders(self) -> dict[str, type]:
        if self._class_dict is None:
            # builders subclass deepspeed's OpBuilder; make sure its package is importable first
            importlib.import_module("deepspeed.ops.op_builder.builder")
            package = importlib.import_module(OP_BUILDER_PACKAGE)
            self._class_dict = dict(inspect.getmembers(package, inspect.isclass))
        return self._class_dict

    def get_op_builder(self, class_name: str) -> type | None:
        if class_name in _NO_BUILDER:
            return None
        served = self._builders().get(class_name)
        if served is not None and class_name != "NotImplementedBuilder":
            return served
        # an op devshim does not serve: a refusal of its own, so that its error names it and says what to do
        from devshim_core.integrations.deepspeed.op_builders import refusal_for

        return refusal_for(class_name)

    def create_op_builder(self, class_name: str) -> Any:
        builder_class = self.get_op_builder(class_name)
        return None if builder_class is None else builder_class()

    def build_extension(self) -> Any:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    # -- launch environment -------------------------------------------------------------------
    def export_envs(self) -> list[str]:
        # devshim's own switches travel with the job, so remote ranks select the same plugin
        return ["DEVSHIM", *self._devshim_device.collectives.export_env_prefixes]

    def visible_devices_envs(self) -> list[str]:
        return list(self._devshim_device.collectives.visible_devices_envs) or ["DEVSHIM_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} is not a torch.compile backend here; supported: {supported}")
        self._compile_backend = backend


class _AbstractBefore019:
    """What DeepSpeed 0.14.4-0.18's accelerator ABC declares abstract and 0.19's implements (on the ``_torch_*``
    hooks above, which these reuse). Mixed in by :func:`accelerator_class` only where the installed ABC asks."""

    def amp(self: Any) -> Any:
        # ZeRO-3's LinearFunctionForZeroStage3 takes custom_fwd/custom_bwd from here (0.14-0.18)
        return types.SimpleNamespace(custom_fwd=functools.partial(torch.amp.custom_fwd, device_type=self._name),
                                     custom_bwd=functools.partial(torch.amp.custom_bwd, device_type=self._name),
                                     autocast=functools.partial(torch.amp.autocast, self._name))

    def pin_memory(self: Any, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        if self._torch_pins_host_memory or tensor.device.type != "cpu":
            return self._torch_pin_memory(tensor)
        from devshim_core.integrations.deepspeed.aio import mark_io_ready

        return mark_io_ready(tensor)

    def is_pinned(self: Any, tensor: torch.Tensor) -> bool:
        # 0.16-0.18's NVMe swap buffers assert is_pinned() of what the async_io op's new_cpu_locked_tensor gave
        # (0.19 asks the op itself): on a device that does not pin, that memory is still the op's to use directly
        from devshim_core.integrations.deepspeed.aio import is_locked_buffer

        return self._torch_is_pinned(tensor) or is_locked_buffer(tensor)


def accelerator_class() -> type[DevshimAccelerator]:
    """:class:`DevshimAccelerator`, completed with the methods the installed DeepSpeed's ABC still leaves abstract
    (``amp``, ``pin_memory``, ``is_pinned`` before 0.19). Anything else left abstract is a DeepSpeed this
    accelerator was not written for: instantiating it fails naming the methods."""
    missing = set(DevshimAccelerator.__abstractmethods__)
    if not missing & {"amp", "pin_memory", "is_pinned"}:
        return DevshimAccelerator
    return type("DevshimAccelerator", (_AbstractBefore019, DevshimAccelerator), {"__module__": __name__})
