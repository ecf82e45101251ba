"""The device facade is built once from the selected plugin and binds the plugin's own callables."""

from __future__ import annotations

import pytest
import torch

from devshim_core.device import build_device
from devshim_core.errors import PluginError
from devshim_core.plugins import discover
from devshim_core.records import DEVICE_MODULE_API, DeviceReport
from devshim_core.selection import select
from devshim_core.settings import Settings


@pytest.fixture(scope="module")
def cpu_device():
    settings = Settings(forced="cpu_reference")
    registry = discover(settings)
    return build_device(registry, select(registry, settings))


def test_facade_operations_are_the_plugins_functions_bound_once(cpu_device):
    """No dispatch layer: calling the facade calls the plugin's function object itself."""
    module = cpu_device.module
    for name in ("device_count", "current_device", "set_device", "synchronize", "manual_seed", "get_rng_state",
                 "set_rng_state", "stream", "current_stream"):
        assert getattr(cpu_device, name) == getattr(module, name), name
    assert cpu_device.memory_allocated is cpu_device.allocator.memory_allocated
    assert cpu_device.empty_cache is cpu_device.allocator.empty_cache


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
    """A plugin whose device module lacks part of the required API."""

    def __init__(self) -> None:
        for name in DEVICE_MODULE_API:
            if name not in ("Stream", "current_stream"):
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
    with pytest.raises(PluginError, match=r"'incomplete'.*lacks Stream, current_stream"):
        build_device(registry, select(registry, settings))
