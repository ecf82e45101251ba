"""The device facade is built once from the selected plugin and binds the plugin's own callables."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from devshim_core.device import build_device
from devshim_core.errors import ConfigError, DeviceSetupError, PluginError
from devshim_core.plugins import discover
from devshim_core.records import DEVICE_MODULE_API, DeviceReport, DeviceTraits
from devshim_core.selection import select
from devshim_core.settings import Settings


@pytest.fixture(scope="module")
def cpu_device():
    settings = Settings(forced="cpu_reference")
    registry = discover(settings)
    return build_device(registry, select(registry, settings))


def test_facade_operations_are_the_plugins_functions_bound_once(cpu_device):
    """No dispatch layer: calling the facade calls the plugin's function object itself. ``set_device`` alone is
    checked, so that a runtime failure says which rank and device (next spec)."""
    module = cpu_device.module
    for name in ("device_count", "current_device", "synchronize", "manual_seed", "get_rng_state", "set_rng_state"):
        assert getattr(cpu_device, name) == getattr(module, name), name
    assert cpu_device.memory_allocated is cpu_device.allocator.memory_allocated
    assert cpu_device.empty_cache is cpu_device.allocator.empty_cache


def test_a_runtime_failure_setting_the_device_names_the_rank_the_device_the_plugin_and_chains_the_cause(
        cpu_device, monkeypatch):
    runtime_error = RuntimeError("aclrtSetDevice failed, error code 507033")

    def failing_set_device(device):
        raise runtime_error

    monkeypatch.setattr(cpu_device, "_module_set_device", failing_set_device)  # the vendor runtime's answer
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(DeviceSetupError) as raised:
        cpu_device.set_device(1)
    assert str(raised.value).startswith(
        "rank 3 (local rank 1): the cpu_reference plugin's runtime could not set up cpu device 1: RuntimeError: "
        "aclrtSetDevice failed, error code 507033. This process sees ")
    assert raised.value.__cause__ is runtime_error


def test_cpu_facade_reports_the_plugin_and_why_it_was_chosen(cpu_device):
    assert cpu_device.plugin == "cpu_reference"
    assert cpu_device.type == "cpu"
    assert cpu_device.info.selection_reason == "forced by DEVSHIM_PLUGIN=cpu_reference"
    described = cpu_device.describe()
    assert described["backend"] == "gloo"
    assert described["optimizer_kernels"] == {"fused_adamw": True, "host_adam_step": True,
                                              "host_adam_rollback": True}
    assert "bfloat16" in described["supported_dtypes"]


def test_cpu_device_names_ignore_the_rank_index(cpu_device):
    """Every rank shares the host: device(1) is still torch.device('cpu'), as DeepSpeed's CPU accelerator."""
    assert cpu_device.torch_device(1) == torch.device("cpu")
    assert cpu_device.device_name(1) == "cpu"


def test_cpu_rng_state_round_trips(cpu_device):
    state = cpu_device.get_rng_state()
    first = torch.rand(4)
    cpu_device.set_rng_state(state)
    assert torch.equal(first, torch.rand(4))


def test_cpu_memory_accounting_is_real(cpu_device):
    allocated = cpu_device.memory_allocated()
    assert allocated > 0
    assert cpu_device.max_memory_allocated() >= allocated
    assert cpu_device.total_memory() >= cpu_device.available_memory() > 0
    stats = cpu_device.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0


class _ModuleWithoutStreams:
    """A device module without streams, from a plugin whose traits do not say ``streams=False``."""

    def __init__(self) -> None:
        for name in DEVICE_MODULE_API:
            setattr(self, name, lambda *a, **k: None)


class _IncompletePlugin:
    from devshim_core import hookimpl

    @hookimpl
    def devshim_detect(self):
        return DeviceReport(available=True, reason="test device", device_type="privateuseone", device_count=1,
                            priority=5)

    @hookimpl
    def devshim_device_module(self, report):
        return _ModuleWithoutStreams()


def test_a_device_module_missing_required_functions_is_refused_by_name():
    settings = Settings(forced="incomplete")
    registry = discover(settings, extra=[("incomplete", _IncompletePlugin())])
    with pytest.raises(PluginError, match=r"'incomplete'.*lacks Stream, Event, stream, current_stream"):
        build_device(registry, select(registry, settings))


def test_a_device_without_streams_gets_host_streams_with_real_context_and_timing(cpu_device):
    """cpu_reference declares streams=False: contexts switch the current stream, events time the host clock."""
    assert cpu_device.traits.streams is False
    side, default = cpu_device.Stream(), cpu_device.current_stream()
    with cpu_device.stream(side):
        assert cpu_device.current_stream() is side
    assert cpu_device.current_stream() is default is cpu_device.default_stream()
    start, end = cpu_device.Event(enable_timing=True), cpu_device.Event(enable_timing=True)
    start.record()
    sum(range(200_000))
    end.record()
    assert start.elapsed_time(end) > 0
    assert side.query() and end.query()


class _VendorAllocatorPlugin:
    """A device whose allocator reads ACME_ALLOC_CONF, where two keys exclude each other (as Ascend's)."""

    from devshim_core import hookimpl

    @hookimpl
    def devshim_detect(self):
        return DeviceReport(available=True, reason="test device", device_type="cpu", device_count=1, priority=5)

    @hookimpl
    def devshim_device_module(self, report):
        from devshim_cpu_reference.device_module import CpuDeviceModule

        return CpuDeviceModule(1)

    @hookimpl
    def devshim_device_traits(self, report):
        return DeviceTraits(supported_dtypes=(torch.float32,), bf16_supported=False, fp16_supported=False,
                            streams=False)

    @hookimpl
    def devshim_allocator(self, report):
        from devshim_cpu_reference import memory

        def validate(value: str) -> None:
            if "expandable_segments:True" in value and "max_split_size_mb" in value:
                raise ValueError("expandable_segments cannot be combined with max_split_size_mb")

        return dataclasses.replace(memory.allocator_spec(), config_env="ACME_ALLOC_CONF", validate_config=validate)


def test_a_bad_vendor_allocator_setting_is_refused_when_the_device_is_built(monkeypatch):
    settings = Settings(forced="acme")
    registry = discover(settings, extra=[("acme", _VendorAllocatorPlugin())])
    selection = select(registry, settings)
    monkeypatch.setenv("ACME_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:128")
    with pytest.raises(ConfigError, match=r"ACME_ALLOC_CONF='expandable_segments:True,max_split_size_mb:128' is not "
                                          r"valid for the acme device: expandable_segments cannot be combined"):
        build_device(registry, selection)
    monkeypatch.setenv("ACME_ALLOC_CONF", "expandable_segments:True")
    assert build_device(registry, selection).allocator.config_env == "ACME_ALLOC_CONF"
