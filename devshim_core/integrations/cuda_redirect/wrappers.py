"""Thin wrappers that map a CUDA device argument before calling the original.

Each fast path is one ``if`` on the arguments: a call that names no device forwards at once, and a call that
names one pays a memoised dictionary lookup (``bench/cuda_redirect.py``). The hot ones (torch's factories,
``Tensor.to``, ``Tensor.new_*``) are native (``_native.c``, compiled when devshim-core is installed): a Python
wrapper's frame alone costs more than the redirect may add. Their Python versions here are the fallback
without a compiler, and the specification both are tested against. With the migration log on
(``DEVSHIM_MIGRATION_LOG``) the Python versions are used, and record each call site they redirect.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from devshim_core import import_hooks, migration_log
from devshim_core.integrations.cuda_redirect.device_map import DeviceMap

try:
    from devshim_core.integrations.cuda_redirect import _native  # type: ignore[attr-defined]  # a C extension: mypy reads no .so
except ImportError:  # installed without a C compiler (setup.py builds it optionally)
    _native = None

# the native wrappers cannot record call sites: with the migration log on, the Python ones serve
NATIVE = _native is not None and migration_log.recorder() is None
IMPLEMENTATION = "native" if NATIVE else "python"

Wrapper = Callable[[Callable[..., Any], DeviceMap], Callable[..., Any]]


def _marked(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    functools.update_wrapper(wrapper, original)
    wrapper.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return wrapper


def _register_for_torchscript(wrapper: Callable[..., Any], original: Callable[..., Any]) -> None:
    """TorchScript resolves ``torch.zeros`` by identity: tell it the wrapper is the same aten op, or
    ``@torch.jit.script`` code calling a factory stops compiling."""
    try:
        from torch.jit._builtins import _find_builtin, _register_builtin
    except ImportError:  # pragma: no cover - torch moved it; scripting a factory call then fails loudly
        return
    op = _find_builtin(original)
    if op is not None:
        _register_builtin(wrapper, op)


def _call_name(original: Callable[..., Any]) -> str:
    """``torch.zeros``, ``Tensor.to``, ``Module.to``: how the log names a wrapped call."""
    owner = str(getattr(original, "__qualname__", None) or getattr(original, "__name__", None) or original)
    if "." in owner:  # a method: its class's public name (TensorBase's methods are Tensor's, the factories torch's)
        cls, _, method = owner.rpartition(".")
        cls = cls.removeprefix("_").replace("TensorBase", "Tensor").replace("VariableFunctionsClass", "torch")
        return f"{cls}.{method}"
    return f"{getattr(original, '__module__', None) or 'torch'}.{owner}"


def _changed(spec: Any, mapped: Any) -> bool:
    """Whether the map changed the device (the memo may hand back an equal, not the same, object)."""
    return type(mapped) is not type(spec) or mapped != spec


def _native_wrapper(original: Callable[..., Any], devices: DeviceMap, position: int = -1,
                    kinds: tuple[type, ...] | None = None) -> Callable[..., Any]:
    assert _native is not None
    return _marked(_native.device_argument(original, devices, devices.memo, position, kinds), original)


def _allow_in_compiled_graphs(wrapper: Callable[..., Any]) -> None:
    """torch.compile inlines a Python wrapper but cannot trace into a native one: put it in the graph as one call
    instead, which FakeTensor and AOTAutograd then run, mapping the device as eager code does. Registered when
    torch._dynamo is imported (importing it here would cost every script a second)."""
    alive = weakref.ref(wrapper)

    def register(dynamo: ModuleType) -> None:
        target = alive()
        if target is not None:
            dynamo.allow_in_graph(target)

    import_hooks.after_import("torch._dynamo", register)


def device_keyword(original: Callable[..., Any], devices: DeviceMap, *, native: bool = NATIVE) -> Callable[..., Any]:
    """A ``device=`` keyword mapped: functions, and methods alike (``self`` rides in ``args``), e.g.
    ``Tensor.new_zeros(..., device='cuda')``, ``Module.to_empty(device='cuda')``."""
    if native:
        return _native_wrapper(original, devices)
    log, name = migration_log.recorder(), _call_name(original)

    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            device = kwargs.get("device")
            if device is not None:
                mapped = kwargs["device"] = devices(device)
                if log is not None and _changed(device, mapped):
                    log.call(name, "served", "device={!r} -> {}", device, mapped)
        return original(*args, **kwargs)

    return _marked(call, original)


def factory(original: Callable[..., Any], devices: DeviceMap, *, native: bool = NATIVE) -> Callable[..., Any]:
    """``torch.zeros(..., device='cuda')``: every torch factory takes ``device`` by keyword."""
    wrapped = device_keyword(original, devices, native=native)
    _register_for_torchscript(wrapped, original)
    if native:
        _allow_in_compiled_graphs(wrapped)
    return wrapped


def first_argument_device(original: Callable[..., Any], devices: DeviceMap) -> Callable[..., Any]:
    """``torch.set_default_device('cuda')`` and others whose device comes first or by keyword."""
    log, name = migration_log.recorder(), _call_name(original)

    def call(*args: Any, **kwargs: Any) -> Any:
        if args:
            device, mapped = args[0], devices(args[0])
            args = (mapped, *args[1:])
        elif "device" in kwargs:
            device = kwargs["device"]
            mapped = kwargs["device"] = devices(device)
        else:
            return original(*args, **kwargs)
        if log is not None and _changed(device, mapped):
            log.call(name, "served", "device {!r} -> {}", device, mapped)
        return original(*args, **kwargs)

    return _marked(call, original)


_DEVICE_KINDS = (str, int, torch.device)


def method_to(original: Callable[..., Any], devices: DeviceMap, *, native: bool = NATIVE) -> Callable[..., Any]:
    """``Tensor.to`` / ``Module.to``: the device is the first positional (a str, an int or a torch.device;
    a dtype or a tensor there is left alone) or the ``device`` keyword."""
    if native:
        return _native_wrapper(original, devices, position=1, kinds=_DEVICE_KINDS)
    log, name = migration_log.recorder(), _call_name(original)

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = mapped = None
        if args:
            if type(args[0]) in _DEVICE_KINDS:
                device, mapped = args[0], devices(args[0])
                args = (mapped, *args[1:])
        elif kwargs:
            device = kwargs.get("device")
            if device is not None:
                mapped = kwargs["device"] = devices(device)
        if log is not None and _changed(device, mapped):
            log.call(name, "served", "device {!r} -> {}", device, mapped)
        return original(self, *args, **kwargs)

    return _marked(to, original)


def tensor_cuda(original: Callable[..., Any], devices: DeviceMap) -> Callable[..., Any]:
    """``Tensor.cuda(device=None)``: to the selected device (the current index unless one is named)."""
    facade = devices.device
    log = migration_log.recorder()

    def cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
        if log is not None:
            log.call("Tensor.cuda", "served", "to {}", facade.type)
        return self.to(facade.torch_device(devices.index(device)), non_blocking=non_blocking, **kwargs)

    return _marked(cuda, original)


def module_cuda(original: Callable[..., Any], devices: DeviceMap) -> Callable[..., Any]:
    """``Module.cuda(device=None)``: parameters and buffers to the selected device."""
    facade = devices.device
    log = migration_log.recorder()

    def cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        if log is not None:
            log.call("Module.cuda", "served", "to {}", facade.type)
        return self.to(facade.torch_device(devices.index(device)))

    return _marked(cuda, original)


def backend_keyword(original: Callable[..., Any], devices: DeviceMap, position: int | None) -> Callable[..., Any]:
    """``init_process_group(backend='nccl')``, ``new_group(..., backend='nccl')``: the plugin's backend.

    ``position`` is where the backend sits when passed positionally (``None``: keyword only). A CUDA
    ``device_id`` (eager NCCL initialisation) is dropped: it names a device that is not there.
    """
    plugin_backend = devices.device.collectives.backend
    log, name = migration_log.recorder(), f"torch.distributed.{getattr(original, '__name__', 'call')}"

    def call(*args: Any, **kwargs: Any) -> Any:
        backend = None
        if position is not None and len(args) > position:
            if _is_nccl(args[position]):
                backend, args = args[position], (*args[:position], plugin_backend, *args[position + 1:])
        elif _is_nccl(kwargs.get("backend")):
            backend, kwargs["backend"] = kwargs["backend"], plugin_backend
        if log is not None and backend is not None:
            log.call(name, "served", "backend {!r} -> {!r}", backend, plugin_backend)
        device_id = kwargs.get("device_id")
        if device_id is not None and devices(device_id) is not device_id:
            del kwargs["device_id"]
        return original(*args, **kwargs)

    return _marked(call, original)


def flat_buffers(original: Callable[..., Any]) -> Callable[..., Any]:
    """``all_gather_into_tensor(output, input)`` / ``reduce_scatter_tensor(output, input)`` read as NCCL reads
    them: two flat buffers, whatever their shapes (Megatron gathers a [2, 4] shard into a flat [16]). gloo
    insists that the larger tensor splits into chunks shaped like the smaller one; given contiguous tensors whose
    trailing shapes differ, both are passed as flat views of the same memory. Anything else goes through as is."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2:
            output, input_ = args[0], args[1]
            if (isinstance(output, torch.Tensor) and isinstance(input_, torch.Tensor)
                    and output.shape[1:] != input_.shape[1:] and output.is_contiguous() and input_.is_contiguous()):
                args = (output.view(-1), input_.view(-1), *args[2:])
        return original(*args, **kwargs)

    return _marked(call, original)


def _is_nccl(backend: Any) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def autocast_init(original: Callable[..., Any], devices: DeviceMap) -> Callable[..., Any]:
    """``autocast('cuda')``: autocast on the selected device, with CUDA's default dtype (float16) unless the
    script names one, so a script gets the precision it was written for."""

    log = migration_log.recorder()

    def __init__(self: Any, device_type: Any, *args: Any, **kwargs: Any) -> None:
        if device_type == "cuda":
            device_type = devices.type
            if log is not None:
                log.call("torch.autocast", "served", "device_type 'cuda' -> {!r}", devices.type)
            if not args and kwargs.get("dtype") is None:
                kwargs["dtype"] = torch.float16
        original(self, device_type, *args, **kwargs)

    return _marked(__init__, original)


def grad_scaler_init(original: Callable[..., Any], devices: DeviceMap) -> Callable[..., Any]:
    """``GradScaler()`` / ``GradScaler('cuda')`` (``'cuda'`` is its default): scale on the selected device."""

    def __init__(self: Any, device: Any = "cuda", *args: Any, **kwargs: Any) -> None:
        original(self, devices.device_type(device), *args, **kwargs)

    return _marked(__init__, original)


def custom_amp(original: Callable[..., Any], devices: DeviceMap) -> Callable[..., Any]:
    """``torch.amp.custom_fwd/custom_bwd(device_type='cuda')``: read the selected device's autocast state."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if "device_type" in kwargs:
            kwargs["device_type"] = devices.device_type(kwargs["device_type"])
        return original(*args, **kwargs)

    return _marked(call, original)


def _instances_of_base(cls: Any, instance: Any) -> bool:
    return isinstance(instance, cls.base)


def _subclasses_of_base(cls: Any, subclass: type) -> bool:
    return issubclass(subclass, cls.base)


def generator_class(original: type, devices: DeviceMap) -> type:
    """``torch.Generator(device='cuda')``: the selected device's generator. ``torch.Generator`` is a C type that cannot
    be patched in place; the replacement is a subclass (a class, as the original) whose construction returns the
    original's own instance, made on the mapped device. Its metaclass derives from the original's (torch gives it
    one) and makes every generator torch makes (``torch.default_generator``, the vendor's) an instance of it."""

    def __new__(cls: type, device: Any = None) -> Any:
        return original() if device is None else original(devices(device))

    meta = type(original)
    meta = type(f"Devshim{meta.__name__}", (meta,), {"__instancecheck__": _instances_of_base,
                                                     "__subclasscheck__": _subclasses_of_base})
    return meta("Generator", (original,), {"__new__": __new__, "base": original, "__module__": "torch",
                                           "__doc__": original.__doc__, "__devshim_original__": original})
