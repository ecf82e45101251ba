"""The device facade: built once from the selected plugin's hook answers, then called by every integration.

Each operation is the plugin's own callable bound as an attribute, so a framework calling
``device.synchronize()`` reaches the vendor function with no dispatch in between.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from devshim_core import host_defaults
from devshim_core.errors import ConfigError, DeviceSetupError, DevshimError, PluginError
from devshim_core.host_streams import HostEvent, HostStream, HostStreams
from devshim_core.patching import Patch
from devshim_core.plugins import PluginRecord, PluginRegistry
from devshim_core.record_checks import check_record
from devshim_core.records import (
    DEVICE_MODULE_API,
    STREAM_API,
    AllocatorSpec,
    CollectivesSpec,
    DeviceReport,
    DeviceTraits,
    FusedKernels,
    OffloadIO,
    OptimizerKernels,
)
from devshim_core.selection import Selection
from devshim_core.stream_context import reusable

# plugins whose CollectivesSpec.prepare ran in this process: a backend is registered once per process
_prepared_plugins: set[str] = set()


@dataclass(frozen=True)
class DeviceInfo:
    """What the facade was built from, for reports."""

    plugin: str
    distribution: str | None
    version: str | None
    selection_reason: str
    report: DeviceReport


class Device:
    """The selected device, as the integrations see it."""

    def __init__(self, info: DeviceInfo, module: Any, traits: DeviceTraits, collectives: CollectivesSpec,
                 allocator: AllocatorSpec, optimizer: OptimizerKernels, attention: FusedKernels,
                 offload_io: OffloadIO, patches: tuple[Patch, ...]) -> None:
        self.info = info
        self.type: str = info.report.device_type
        self.module = module
        self.traits = traits
        self.collectives = collectives
        self.allocator = allocator
        self.optimizer = optimizer
        self.attention = attention
        self.offload_io = offload_io
        self.patches = patches

        # device and RNG: the plugin's functions, bound once
        self.is_available = module.is_available
        self.device_count = module.device_count
        self.current_device = module.current_device
        self._module_set_device = module.set_device
        self.synchronize = module.synchronize
        self.manual_seed = module.manual_seed
        self.manual_seed_all = module.manual_seed_all
        self.initial_seed = module.initial_seed
        self.get_rng_state = module.get_rng_state
        self.set_rng_state = module.set_rng_state
        if traits.streams:
            self.Stream = module.Stream
            self.Event = module.Event
            self.stream = reusable(module.stream)
            self.current_stream = module.current_stream
            self.default_stream = module.default_stream
        else:  # host-synchronous bookkeeping: contexts and timings are real, waits are already satisfied
            streams = HostStreams()
            self.Stream, self.Event = HostStream, HostEvent
            self.stream = reusable(streams.stream)
            self.current_stream = streams.current_stream
            self.default_stream = streams.default_stream

        # allocator
        self.memory_allocated = allocator.memory_allocated
        self.max_memory_allocated = allocator.max_memory_allocated
        self.memory_reserved = allocator.memory_reserved
        self.max_memory_reserved = allocator.max_memory_reserved
        self.reset_peak_memory_stats = allocator.reset_peak_memory_stats
        self.memory_stats = allocator.memory_stats
        self.empty_cache = allocator.empty_cache
        self.total_memory = allocator.total_memory
        self.available_memory = allocator.available_memory

    @property
    def plugin(self) -> str:
        return self.info.plugin

    def set_device(self, device: Any) -> None:
        """The plugin's ``set_device``; a runtime failure becomes a :class:`DeviceSetupError` saying where."""
        try:
            self._module_set_device(device)
        except DevshimError:
            raise
        except Exception as exc:
            raise DeviceSetupError(self._setup_failure(device, exc)) from exc

    def _setup_failure(self, device: Any, exc: Exception) -> str:
        rank, local = os.environ.get("RANK"), os.environ.get("LOCAL_RANK")
        where = f"rank {rank} (local rank {local})" if rank is not None else f"process {os.getpid()}"
        visible = ""
        if self.collectives.visible_devices_envs:
            name = self.collectives.visible_devices_envs[0]
            visible = f" {name}={os.environ[name]!r} in this process." if name in os.environ else f" {name} is unset."
        return (f"{where}: the {self.plugin} plugin's runtime could not set up {self.type} device {device!r}: "
                f"{type(exc).__name__}: {exc}. This process sees {self.device_count()} {self.type} device(s);"
                f"{visible} Check that device with the vendor's tools, or leave it out of the job.")

    def torch_device(self, index: int | None = None) -> torch.device:
        if index is None or self.type == "cpu":  # a CPU has one torch device whatever the rank
            return torch.device(self.type)
        return torch.device(self.type, index)

    def device_name(self, index: int | None = None) -> str:
        if index is None or self.type == "cpu":
            return self.type
        return f"{self.type}:{index}"

    def prepare_process(self) -> None:
        """Run the plugin's per-process collectives preparation, once per process whatever re-activates."""
        prepare = self.collectives.prepare
        if prepare is not None and self.plugin not in _prepared_plugins:
            prepare()
            _prepared_plugins.add(self.plugin)

    def describe(self) -> dict[str, Any]:
        optimizer, attention = self.optimizer, self.attention
        return {
            "plugin": self.plugin,
            "device_type": self.type,
            "device_count": self.info.report.device_count,
            "name": self.traits.name,
            "supported_dtypes": [str(d).replace("torch.", "") for d in self.traits.supported_dtypes],
            "backend": self.collectives.backend,
            "optimizer_kernels": {k: getattr(optimizer, k) is not None
                                  for k in ("fused_adamw", "host_adam_step", "host_adam_rollback")},
            "attention_kernels": {k: getattr(attention, k) is not None
                                  for k in ("attention", "rms_norm", "swiglu", "rotary", "masked_softmax",
                                            "wgrad_accumulate", "grouped_gemm")},
            "kernel_sources": {"optimizer": optimizer.source, "attention": attention.source},
            "offload_io": {"file_io": self.offload_io.file_io is not None, "source": self.offload_io.source},
        }


def _checked(registry: PluginRegistry, record: PluginRecord, hook: str, expected: type | None,
             default: Any = None) -> Any:
    answer = registry.ask(record, hook)
    if answer is None:
        if default is None:
            raise PluginError(f"plugin {record.name!r} does not implement {hook}, which a selectable plugin must.")
        return default
    if expected is not None and not isinstance(answer, expected):
        raise PluginError(f"plugin {record.name!r}: {hook} returned {type(answer).__name__}, "
                          f"expected {expected.__name__}.")
    if dataclasses.is_dataclass(answer):
        check_record(answer, record.name, hook)
    return answer


def _with_reference_ops(kernels: FusedKernels) -> FusedKernels:
    """``kernels`` with devshim_kernels' portable ops where the plugin has none: grouped GEMM (a loop of matmuls;
    without it MoE's ``--moe-grouped-gemm`` has no path off CUDA) and, for a plugin with attention, attention with
    its log-sum-exp (ring context parallelism merges blocks by it). Both run on any device."""
    try:
        from devshim_kernels import attention_with_lse, grouped_gemm
    except ImportError:  # devshim-kernels not installed: the ops stay None and their users refuse by name
        return kernels
    filled: dict[str, Any] = {}
    if kernels.grouped_gemm is None:
        filled["grouped_gemm"] = grouped_gemm
    if kernels.attention_lse is None and kernels.attention is not None:
        filled["attention_lse"] = attention_with_lse
    if not filled:
        return kernels
    source = kernels.source if kernels.source in ("", "devshim_kernels") else (
        f"{kernels.source}; {', '.join(filled)}: devshim_kernels")
    return dataclasses.replace(kernels, **filled, source=source)


def _check_allocator_config(plugin: str, allocator: AllocatorSpec) -> None:
    """Refuse a vendor allocator setting the vendor would reject later, mid-training, or silently ignore."""
    value = os.environ.get(allocator.config_env) if allocator.config_env else None
    if not value or allocator.validate_config is None:
        return
    try:
        allocator.validate_config(value)
    except ValueError as exc:
        raise ConfigError(f"{allocator.config_env}={value!r} is not valid for the {plugin} device: {exc}") from exc


def _reference_kernels(plugin: str, optimizer: OptimizerKernels,
                       attention: FusedKernels) -> tuple[OptimizerKernels, FusedKernels]:
    """devshim-kernels' reference ops in place of every kernel the plugin serves (``DEVSHIM_REFERENCE_KERNELS=1``).
    An op the plugin leaves out stays out, so that the same paths run as without the switch."""
    try:
        reference_attention = _with_reference_ops(host_defaults.reference_fused_kernels())
        reference_optimizer = host_defaults.reference_optimizer_kernels()
    except ImportError as exc:
        raise ConfigError(f"DEVSHIM_REFERENCE_KERNELS=1 needs devshim-kernels, which is not installed ({exc}): "
                          "pip install devshim-kernels") from exc
    note = f"devshim_kernels (DEVSHIM_REFERENCE_KERNELS=1, in place of the {plugin} plugin's)"
    return _in_place_of(optimizer, reference_optimizer, note), _in_place_of(attention, reference_attention, note)


def _in_place_of(own: Any, reference: Any, source: str) -> Any:
    """The kernel record ``own`` with each op it serves replaced by ``reference``'s, and ``source`` as its source."""
    return dataclasses.replace(own, source=source, **{
        f.name: getattr(reference, f.name) for f in dataclasses.fields(own)
        if f.name != "source" and getattr(own, f.name) is not None})


def build_device(registry: PluginRegistry, selection: Selection, reference_kernels: bool = False) -> Device:
    """Ask the selected plugin for its answers, validate them and bind them into one :class:`Device`
    (``reference_kernels``: with devshim-kernels' ops in place of the plugin's, see :func:`_reference_kernels`)."""
    record = selection.plugin
    assert record.report is not None
    traits = _checked(registry, record, "devshim_device_traits", DeviceTraits,
                      DeviceTraits(supported_dtypes=(torch.float32,), bf16_supported=False, fp16_supported=False))
    module = _checked(registry, record, "devshim_device_module", None)
    required = DEVICE_MODULE_API + (STREAM_API if traits.streams else ())
    missing = [name for name in required if not hasattr(module, name)]
    if missing:
        raise PluginError(f"plugin {record.name!r}: the device module lacks {', '.join(missing)}.")
    collectives = _checked(registry, record, "devshim_collectives", CollectivesSpec, CollectivesSpec("gloo"))
    allocator = _checked(registry, record, "devshim_allocator", AllocatorSpec)
    _check_allocator_config(record.name, allocator)
    optimizer = _checked(registry, record, "devshim_optimizer_kernels", OptimizerKernels, OptimizerKernels())
    attention = _with_reference_ops(_checked(registry, record, "devshim_attention_kernels", FusedKernels,
                                            FusedKernels()))
    if reference_kernels:  # devshim compare --reference kernels: the device's own runtime, devshim's kernels
        optimizer, attention = _reference_kernels(record.name, optimizer, attention)
    # host file I/O is the same whatever the device: a plugin that does not answer gets devshim's (host_defaults)
    offload_io = _checked(registry, record, "devshim_offload_io", OffloadIO, host_defaults.offload_io())
    patch_lists = _checked(registry, record, "devshim_patches", list, [])
    answers = [answer for answer in patch_lists if answer is not None]
    if any(not isinstance(answer, (list, tuple)) for answer in answers):
        raise PluginError(f"plugin {record.name!r}: devshim_patches must return a list of Patch objects, got "
                          f"{[type(a).__name__ for a in answers]}.")
    patches = tuple(p for answer in answers for p in answer)
    bad = [p for p in patches if not isinstance(p, Patch)]
    if bad:
        raise PluginError(f"plugin {record.name!r}: devshim_patches returned non-Patch items {bad!r:.200}.")
    info = DeviceInfo(plugin=record.name, distribution=record.distribution, version=record.version,
                      selection_reason=selection.reason, report=record.report)
    return Device(info, module, traits, collectives, allocator, optimizer, attention, offload_io, patches)
