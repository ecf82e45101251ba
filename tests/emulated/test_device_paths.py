"""Spec: with devshim activated through the vendor plugin on the emulated device, every device path a framework
takes (device indices, DeepSpeed's accelerator, streams and events, pinned memory, memory statistics, the RNG,
device checks, allocator settings, process-group options) lands on the vendor's API and behaves as on hardware.

Run once per vendor, each in a process of its own (``DEVSHIM_EMULATE=ascend pytest tests/emulated``, then
sophgo). devshim's session is process-wide: this module activates it once, and the specs that need a fresh
activation deactivate it and leave it activated again as they found it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from devshim_core import cli, session
from devshim_core.errors import ConfigError
from devshim_core.patching import REGISTRY
from emulated.conftest import DEVICE_TYPE, VENDOR, only

SDK = {"ascend": "torch_npu", "sophgo": "torch_tpu"}[VENDOR]
BACKEND = {"ascend": "hccl", "sophgo": "sccl"}[VENDOR]
ALLOC_CONF = {"ascend": "PYTORCH_NPU_ALLOC_CONF", "sophgo": "PYTORCH_TPU_ALLOC_CONF"}[VENDOR]
MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def activated() -> Iterator[None]:
    session.activate()
    importlib.import_module("deepspeed")  # fires the armed DeepSpeed patches, as a training script's import does
    yield
    session.deactivate()


@pytest.fixture
def active() -> session.Session:
    current = session.current()
    assert current is not None, "devshim is not activated"
    return current


@pytest.fixture
def dev(active: session.Session) -> Any:
    return active.device


@pytest.fixture
def mod() -> Any:
    """The vendor's device module, as its SDK registered it (``torch.npu`` / ``torch.tpu``)."""
    return getattr(torch, DEVICE_TYPE)


@pytest.fixture
def acc() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


@pytest.fixture
def rng_restored(mod: Any) -> Iterator[None]:
    host, device = torch.get_rng_state(), mod.get_rng_state_all()
    yield
    torch.set_rng_state(host)
    mod.set_rng_state_all(device)


@contextlib.contextmanager
def fresh_activation() -> Iterator[None]:
    """Drop this module's session for the block (which activates as it likes), then activate plainly again."""
    session.deactivate()
    try:
        yield
    finally:
        session.deactivate()
        session.activate()


# -- selection and reports -------------------------------------------------------------------------------------------

def test_the_vendor_plugin_drives_the_emulated_device(active, mod):
    assert active.selection.plugin.name == VENDOR
    assert active.device.type == DEVICE_TYPE
    assert getattr(sys.modules[SDK], "EMULATED", False) is True  # the simulated SDK, imported by the plugin
    assert active.device.module is mod  # the module the SDK registered as torch.<device>
    assert active.device.collectives.backend == BACKEND


def test_devshim_info_data_names_the_vendor_and_says_the_device_is_emulated():
    report = cli.info_report()
    assert report["selected"] == VENDOR
    assert report["device"]["device_type"] == DEVICE_TYPE
    notice = report["emulation"]
    assert "EMULATED" in notice and "NOT HARDWARE" in notice
    assert f"DEVSHIM_EMULATE={VENDOR}" in notice
    json.dumps(report, default=str)  # what `devshim info --json` prints


# -- device indices --------------------------------------------------------------------------------------------------

def test_an_indexed_torch_device_is_that_index_of_the_vendor_device_and_tensors_made_there_stay_there(dev, acc):
    target = dev.torch_device(1)
    assert target == torch.device(DEVICE_TYPE, 1)
    assert dev.device_name(1) == f"{DEVICE_TYPE}:1" == acc.device_name(1)
    assert acc.device(1) == target
    x = torch.arange(6, dtype=torch.float32, device=target)
    y = (x * 2).reshape(2, 3).sum(0)
    assert x.device == y.device == target
    assert y.cpu().tolist() == [6.0, 10.0, 14.0]
    assert dev.current_device() == 0  # making a tensor on index 1 does not move the current device


# -- DeepSpeed's accelerator -----------------------------------------------------------------------------------------

def test_deepspeeds_accelerator_is_devshims_on_the_vendor_device(acc, dev):
    from devshim_core.integrations.deepspeed.accelerator import DevshimAccelerator

    assert isinstance(acc, DevshimAccelerator)
    assert acc._devshim_device is dev
    assert acc.device_name() == DEVICE_TYPE
    assert acc.communication_backend_name() == BACKEND


def test_deepspeeds_legacy_tensor_types_make_tensors_on_the_current_vendor_device(acc, mod):
    floats = acc.FloatTensor(2, 3)
    assert floats.device == torch.device(DEVICE_TYPE, mod.current_device())
    assert floats.dtype == torch.float32 and floats.shape == (2, 3)
    with mod.device(1):
        assert acc.FloatTensor(4).device == torch.device(DEVICE_TYPE, 1)
    assert acc.IntTensor([1, 2]).cpu().tolist() == [1, 2]


def test_deepspeeds_long_tensor_is_int64_on_ascend_and_int32_on_sophgo_which_has_no_int64(acc, dev):
    longs = acc.LongTensor(2)
    assert longs.device.type == DEVICE_TYPE
    assert longs.dtype == {"ascend": torch.int64, "sophgo": torch.int32}[VENDOR]
    assert dev.traits.int64_supported is (VENDOR == "ascend")


def test_an_asynchronous_device_tells_deepspeed_to_use_device_events_and_explicit_dependencies(dev, acc):
    assert dev.traits.host_synchronous is False
    assert acc.is_synchronized_device() is False
    assert acc.use_host_timers() is False
    assert acc.resolves_data_dependency() is False
    assert acc.handles_memory_backpressure() is False


# -- streams and events ----------------------------------------------------------------------------------------------

def test_the_facade_and_deepspeed_call_the_vendor_modules_own_stream_and_event_api(dev, acc, mod):
    vendor_module = getattr(importlib.import_module(SDK), "npu" if VENDOR == "ascend" else "tpu")
    assert dev.traits.streams is True
    assert dev.Stream is mod.Stream is vendor_module.Stream
    assert dev.Event is mod.Event is vendor_module.Event
    # (the facade's stream() wraps the module's in a re-enterable context: the next tests enter it; set_device
    # wraps the module's so that a runtime failure names the rank and device)
    for name in ("current_stream", "default_stream", "synchronize", "current_device",
                 "manual_seed", "get_rng_state", "set_rng_state"):
        bound = getattr(dev, name)
        assert bound == getattr(mod, name), f"facade {name} is not {DEVICE_TYPE}'s own"
        assert getattr(bound, "__self__", None) is mod, name
    assert dev._module_set_device == mod.set_device and dev._module_set_device.__self__ is mod
    assert acc.Stream is mod.Stream and acc.Event is mod.Event
    assert acc.current_stream() == mod.current_stream()


def test_a_side_stream_context_makes_the_stream_current_and_restores_the_previous_one(dev, mod):
    default = dev.current_stream()
    assert default == dev.default_stream()
    side = dev.Stream()
    assert side != default and side.device_index == 0
    with dev.stream(side):
        assert dev.current_stream() == side == torch.accelerator.current_stream()
        nested = dev.Stream()
        with dev.stream(nested):
            assert dev.current_stream() == nested
        assert dev.current_stream() == side
    assert dev.current_stream() == default
    with pytest.raises(ZeroDivisionError), dev.stream(side):
        1 / 0  # noqa: B018
    assert dev.current_stream() == default  # restored on the way out of an exception too
    for context in (dev.stream(side), mod.stream(side)):  # entered twice, as torch's StreamContext allows and
        for _ in range(2):                                 # Megatron does; the vendor module's own too
            with context:
                assert dev.current_stream() == side
            assert dev.current_stream() == default


def test_a_stream_of_another_device_is_current_there_inside_the_context_and_everything_is_restored(dev, mod):
    """As ``torch.cuda.stream``: entering a stream of device 1 makes device 1 current; leaving restores the
    current device and the current stream of both devices."""
    default_0, default_1 = dev.current_stream(0), dev.current_stream(1)
    side = dev.Stream(1)
    assert side.device_index == 1
    with dev.stream(side):
        assert dev.current_device() == 1
        assert dev.current_stream(1) == side
        assert dev.current_stream(0) == default_0
        assert torch.ones(1, device=DEVICE_TYPE).device == torch.device(DEVICE_TYPE, 1)
    assert dev.current_device() == 0
    assert dev.current_stream(0) == default_0 and dev.current_stream(1) == default_1


def test_cross_stream_waits_and_event_timing(dev):
    """The synchronisation API runs on the vendor's stream and event types (``wait_stream``, ``record_event``,
    ``Event.wait``, ``wait_event``, ``query``, ``synchronize``), results computed on a side stream are right once
    waited for, and event timing is real host time between records: positive, monotonic, and at least a sleep
    taken between two records. (Kernels run when called; only copies are held back, see the next spec.)"""
    start, middle, end = (dev.Event(enable_timing=True) for _ in range(3))
    main = dev.current_stream()
    side = dev.Stream()
    start.record()
    x = torch.randn(64, 64, device=dev.torch_device(0))
    time.sleep(0.02)
    middle.record()
    side.wait_stream(main)
    with dev.stream(side):
        y = x @ x
        done = side.record_event()
    done.wait(main)
    main.wait_event(done)
    end.record()
    assert isinstance(done, torch.Event) and done.query() and side.query() and main.query()
    end.synchronize()
    side.synchronize()
    assert torch.allclose(y.cpu(), x.cpu() @ x.cpu(), atol=1e-5)
    first, whole = start.elapsed_time(middle), start.elapsed_time(end)
    assert first >= 20.0  # milliseconds: the sleep between the two records
    assert whole >= first > 0
    assert middle.elapsed_time(end) >= 0


def test_a_copy_issued_on_a_side_stream_is_seen_only_after_the_stream_is_waited_for(dev, mod):
    """Copies issued on a side stream are queued there, as on the hardware, and land when the stream is
    synchronized with: an event of it waited on, ``wait_stream``, ``Event``/stream/device ``synchronize``. A
    reader on another stream that forgot to wait sees stale data, every time (real hardware would race). Later
    work on the same stream sees the stream's earlier copies: a stream keeps its own order."""
    device = dev.torch_device(0)
    source = torch.full((4,), 7.0, device=device)
    target = torch.zeros(4, device=device)
    main, side = dev.current_stream(), dev.Stream()

    with dev.stream(side):
        target.copy_(source)
    assert mod.pending_copies() == 1 and not side.query()
    assert target.cpu().tolist() == [0.0] * 4  # read on the default stream with no wait: not there yet
    main.wait_stream(side)
    assert target.cpu().tolist() == [7.0] * 4 and mod.pending_copies() == 0 and side.query()

    host = torch.zeros(4)
    with dev.stream(side):
        host.copy_(source * 2)  # device to host: the product is computed now, the host copy lands later
        copied = side.record_event()
    assert host.tolist() == [0.0] * 4 and not copied.query()
    copied.wait(main)
    assert host.tolist() == [14.0] * 4

    with dev.stream(side):
        target.copy_(torch.ones(4))
        in_order = target + 1  # the same stream: runs after, and sees, its own earlier copy
    side.record_event().synchronize()
    assert in_order.cpu().tolist() == [2.0] * 4 and target.cpu().tolist() == [1.0] * 4

    with dev.stream(side):
        target.copy_(source)
    dev.synchronize()  # the facade's synchronize is the vendor module's: the device's streams drain
    assert target.cpu().tolist() == [7.0] * 4 and mod.pending_copies() == 0


# -- pinned memory ---------------------------------------------------------------------------------------------------

def test_deepspeeds_pin_memory_pins_host_memory_with_the_vendor_allocator(acc, mod):
    before = mod.pinned_bytes()
    plain = torch.empty(10)
    assert plain.is_pinned() is False
    pinned = acc.pin_memory(plain)
    assert pinned.is_pinned() is True and acc.is_pinned(pinned) is True
    assert pinned.device.type == "cpu"
    assert mod.pinned_bytes() == before + 10 * 4
    del pinned
    assert mod.pinned_bytes() == before  # freed back to the pinned allocator


# -- collectives preparation -----------------------------------------------------------------------------------------

PREPARE_COUNTER = """
import dataclasses, importlib, json, sys
from devshim_core import hookimpl, session

plugin = importlib.import_module(sys.argv[1])
original = plugin.devshim_collectives
calls = {"hook": 0, "prepare": 0}

@hookimpl
def devshim_collectives(report):
    calls["hook"] += 1
    spec = original(report)
    def counted():
        calls["prepare"] += 1
        return spec.prepare()
    return dataclasses.replace(spec, prepare=counted)

plugin.devshim_collectives = devshim_collectives  # what discovery registers: every activation asks it
for _ in range(3):
    session.activate()
    session.deactivate()
session.activate()
print(json.dumps(calls))
"""


def test_the_plugins_collectives_preparation_runs_once_per_process_across_reactivations():
    """A fresh process activates, deactivates and re-activates four times: the plugin is asked for its
    collectives spec each time, and its ``prepare`` runs the first time only."""
    result = subprocess.run([sys.executable, "-c", PREPARE_COUNTER, f"devshim_{VENDOR}"], env=dict(os.environ),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"hook": 4, "prepare": 1}


# -- memory ----------------------------------------------------------------------------------------------------------

def test_memory_statistics_are_kept_per_device_index(dev, acc, mod):
    allocated = {i: dev.memory_allocated(i) for i in (0, 1)}
    mod.reset_peak_memory_stats(1)
    x = torch.empty(MiB, dtype=torch.uint8, device=dev.torch_device(1))
    assert dev.memory_allocated(1) == allocated[1] + MiB == acc.memory_allocated(1)
    assert dev.memory_allocated(0) == allocated[0]
    assert dev.memory_stats(1)["allocated_bytes.all.current"] == allocated[1] + MiB
    assert dev.max_memory_allocated(1) >= allocated[1] + MiB
    assert dev.memory_reserved(1) >= allocated[1] + MiB
    del x
    assert dev.memory_allocated(1) == allocated[1]
    assert dev.max_memory_allocated(1) >= allocated[1] + MiB  # the peak remembers
    dev.reset_peak_memory_stats(1)
    assert dev.max_memory_allocated(1) == allocated[1]


def test_free_and_total_memory_agree_across_the_vendor_api_the_facade_and_deepspeed(dev, acc, mod):
    free, total = mod.mem_get_info(1)
    assert total == mod.get_device_properties(1).total_memory == dev.total_memory(1) == acc.total_memory(1)
    assert free == dev.available_memory(1) == acc.available_memory(1)
    assert free == total - dev.memory_reserved(1)
    x = torch.empty(MiB, dtype=torch.uint8, device=dev.torch_device(1))
    assert mod.mem_get_info(1) == (free - MiB, total)
    assert mod.mem_get_info(0)[1] == total  # every emulated device reports the same capacity
    del x


# -- random numbers --------------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("rng_restored")
def test_random_ops_on_the_device_draw_from_the_devices_generator_not_the_hosts(dev, mod):
    mod.manual_seed(1234)
    first = torch.randn(8, device=dev.torch_device(0)).cpu()
    mod.manual_seed(1234)
    torch.default_generator.manual_seed(99)  # the host generator alone, elsewhere in its sequence
    torch.rand(17)
    again = torch.randn(8, device=dev.torch_device(0)).cpu()
    assert torch.equal(first, again)
    host = torch.get_rng_state()
    device_state = mod.get_rng_state(0)
    torch.rand(8, device=dev.torch_device(0))
    assert torch.equal(torch.get_rng_state(), host)  # a device draw leaves the host generator alone
    assert not torch.equal(mod.get_rng_state(0), device_state)  # and advances the device's


@pytest.mark.usefixtures("rng_restored")
def test_each_device_index_has_its_own_generator(dev, mod):
    states = {i: mod.get_rng_state(i) for i in (0, 1)}
    torch.rand(8, device=dev.torch_device(1))
    assert torch.equal(mod.get_rng_state(0), states[0])
    assert not torch.equal(mod.get_rng_state(1), states[1])
    with mod.device(1):
        mod.manual_seed(7)  # seeds the current device's generator only
    mod.manual_seed(8)
    on_1 = torch.rand(4, device=dev.torch_device(1)).cpu()
    on_0 = torch.rand(4, device=dev.torch_device(0)).cpu()
    assert torch.equal(on_1, torch.rand(4, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(on_0, torch.rand(4, generator=torch.Generator().manual_seed(8)))


@pytest.mark.usefixtures("rng_restored")
def test_rng_state_round_trips_through_the_vendor_api_the_facade_and_deepspeed(dev, acc, mod):
    state = dev.get_rng_state()
    assert state.device.type == "cpu" and state.dtype == torch.uint8
    drawn = torch.rand(5, device=dev.torch_device(0)).cpu()
    dev.set_rng_state(state)
    assert torch.equal(torch.rand(5, device=dev.torch_device(0)).cpu(), drawn)
    acc.set_rng_state(state, 1)
    assert torch.equal(torch.rand(5, device=dev.torch_device(1)).cpu(), drawn)
    assert torch.equal(acc.get_rng_state(0), mod.get_rng_state(0))


# -- device checks ---------------------------------------------------------------------------------------------------

MIXED_OPS = {
    "add": lambda a, b: a + b,
    "in-place add": lambda a, b: a.clone().add_(b),
    "matmul": lambda a, b: a.view(1, 3) @ b.view(3, 1),
    "cat": lambda a, b: torch.cat([a, b]),
    "where": lambda a, b: torch.where(a > 0, a, b),
}


@pytest.mark.parametrize("op", sorted(MIXED_OPS))
def test_a_host_tensor_mixed_with_a_device_tensor_is_refused(dev, op):
    on_device = torch.ones(3, device=dev.torch_device(0))
    with pytest.raises(RuntimeError, match=rf"Expected all tensors to be on the same device.*{DEVICE_TYPE}:0.*cpu"):
        MIXED_OPS[op](on_device, torch.ones(3))


@pytest.mark.parametrize("op", sorted(MIXED_OPS))
def test_tensors_on_two_indices_of_the_device_are_refused(dev, op):
    with pytest.raises(RuntimeError, match=rf"Expected all tensors to be on the same device.*{DEVICE_TYPE}:0.*"
                                           rf"{DEVICE_TYPE}:1"):
        MIXED_OPS[op](torch.ones(3, device=dev.torch_device(0)), torch.ones(3, device=dev.torch_device(1)))


def test_a_zero_dim_host_tensor_is_a_scalar_and_allowed_with_a_device_tensor(dev):
    result = torch.ones(3, device=dev.torch_device(1)) * torch.tensor(2.5)
    assert result.device == dev.torch_device(1)
    assert result.cpu().tolist() == [2.5, 2.5, 2.5]

def test_moving_a_module_to_the_device_and_back_keeps_each_parameter_object_and_its_attributes(dev):
    # As the vendor runtimes answer _has_compatible_shallow_copy_type: without it Module.to builds new Parameters,
    # and Megatron's tensor_model_parallel / sequence_parallel / allreduce flags vanish (wrong TP grad norms).
    module = torch.nn.Linear(3, 2)
    weight = module.weight
    weight.tensor_model_parallel = True
    module.to(dev.torch_device(1))
    assert module.weight is weight and weight.device == dev.torch_device(1)
    assert weight.tensor_model_parallel is True
    module(torch.ones(1, 3, device=dev.torch_device(1))).sum().backward()
    assert weight.grad.device == dev.torch_device(1)
    module.cpu()
    assert module.weight is weight and weight.device.type == "cpu" and weight.grad.device.type == "cpu"
    assert weight.grad.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]



# -- allocator settings ----------------------------------------------------------------------------------------------

INVALID_CONF = {
    "ascend": {
        "expandable_segments:True,max_split_size_mb:128": "cannot be combined with max_split_size_mb",
        "expandable_segments:True,garbage_collection_threshold:0.6": "cannot be combined",
        "max_split_size_mb:128,unknown_key:1": "unknown key 'unknown_key'",
        "max_split_size_mb": "is not key:value",
        "max_split_size_mb:": "is not key:value",
        "expandable_segments:true": "expandable_segments takes True or False",
        "max_split_size_mb:20": "greater than 20",
        "garbage_collection_threshold:1.0": "strictly between 0 and 1",
        "base_addr_aligned_kb:32": "from 0 to 16",
        "page_size:1G": "'1g'",
    },
    "sophgo": {
        "expandable_segments:True,max_split_size_mb:128": "cannot be combined with max_split_size_mb",
        "max_split_size_mb:128,unknown_key:1": "unknown key 'unknown_key'",
        "max_split_size_mb": "is not key:value",
        "expandable_segments:maybe": "expandable_segments takes True or False",
        "max_split_size_mb:abc": "greater than 20",
        "garbage_collection_threshold:0": "strictly between 0 and 1",
        "roundup_power2_divisions:3": "roundup_power2_divisions takes a power of 2",
        "roundup_power2_divisions:[64:3,>:1]": "roundup_power2_divisions takes a power of 2",
        "roundup_power2_divisions:[100:4]": "roundup_power2_divisions takes a power of 2",
        "roundup_power2_divisions:[64:8,>:1": "never closes",
    },
}
VALID_CONF = {
    "ascend": ["expandable_segments:True", "expandable_segments:False,max_split_size_mb:128",
               "max_split_size_mb:21,garbage_collection_threshold:0.6", " expandable_segments : True ",
               "expandable_segments:True,base_addr_aligned_kb:0", "base_addr_aligned_kb:16", "page_size:1g"],
    "sophgo": ["expandable_segments:True", "max_split_size_mb:128,garbage_collection_threshold:0.8",
               "roundup_power2_divisions:4", "roundup_power2_divisions:[64:8,256:4,1024:4,>:1]",
               "expandable_segments:True,roundup_power2_divisions:[>:0]"],
}


@pytest.fixture
def validate_config() -> Any:
    return importlib.import_module(f"devshim_{VENDOR}.allocator").validate_config


@pytest.mark.parametrize("value", sorted(INVALID_CONF[VENDOR]))
def test_the_vendor_allocator_setting_validator_refuses_what_the_vendor_allocator_refuses(validate_config, value):
    with pytest.raises(ValueError, match=INVALID_CONF[VENDOR][value].replace("[", r"\[")):
        validate_config(value)


@pytest.mark.parametrize("value", VALID_CONF[VENDOR])
def test_the_vendor_allocator_setting_validator_accepts_what_the_vendor_allocator_accepts(validate_config, value):
    validate_config(value)


@pytest.mark.parametrize("value", ["expandable_segments:True,max_split_size_mb:128", "max_split_size_mb:128,bogus:1",
                                   "max_split_size_mb"])
def test_an_invalid_allocator_setting_makes_activation_fail_naming_the_variable(monkeypatch, value):
    with fresh_activation(), monkeypatch.context() as env:
        env.setenv(ALLOC_CONF, value)
        with pytest.raises(ConfigError, match=rf"^{ALLOC_CONF}='{value}' is not valid for the {VENDOR} device: "):
            session.activate()
        assert session.current() is None


def test_a_valid_allocator_setting_activates(monkeypatch):
    with fresh_activation(), monkeypatch.context() as env:
        env.setenv(ALLOC_CONF, VALID_CONF[VENDOR][-1])
        activated = session.activate()
        assert activated.device.allocator.config_env == ALLOC_CONF
        assert activated.selection.plugin.name == VENDOR


# -- process-group options -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def single_rank_group(**kwargs: Any) -> Iterator[Any]:
    assert not dist.is_initialized()
    dist.init_process_group(backend=BACKEND, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield dist.group.WORLD._get_backend(torch.device(DEVICE_TYPE))
    finally:
        dist.destroy_process_group()


@only("sophgo")
def test_on_sophgo_the_plugins_pg_options_reach_init_process_group_with_the_chip_map(active, mod):
    from torch_tpu.tpu import ProcessGroupSCCLOptions

    assert active.integrations["torch.distributed"] == "applied (pg_options)"
    with single_rank_group() as backend:
        assert dist.get_backend() == "sccl"
        assert isinstance(backend.options, ProcessGroupSCCLOptions)
        assert backend.options.chip_map == list(range(mod.device_count()))
        assert backend.options is active.device.collectives.init_kwargs["pg_options"]
    mine = ProcessGroupSCCLOptions()
    mine.chip_map = [3]
    with single_rank_group(pg_options=mine) as backend:
        assert backend.options is mine  # what the caller passes wins


@only("ascend")
def test_on_ascend_no_torch_distributed_patch_is_applied_and_hccl_gets_no_extra_options(active):
    assert not active.device.collectives.init_kwargs
    assert "torch.distributed" not in active.integrations
    assert all(p["set"] != "torch.distributed" for p in REGISTRY.report())
    # only the CUDA redirect (backend='nccl' -> hccl) and the job's plugin check wrap torch's function, two deep
    assert {p["set"] for p in REGISTRY.report() if "init_process_group" in p["target"]} == {
        "cuda-redirect", "torch.distributed-agreement"}
    for function in (dist.init_process_group, dist.distributed_c10d.init_process_group):
        assert not hasattr(function.__devshim_original__.__devshim_original__, "__devshim_original__")
    with single_rank_group() as backend:
        assert dist.get_backend() == "hccl"
        assert backend.options is None
