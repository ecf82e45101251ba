"""Kit: DeepSpeed's accelerator interface on the plugin under test, one expectation per abstract method.

``EXPECTED`` has exactly one check per abstract method or property of DeepSpeed's ``DeepSpeedAccelerator``;
a DeepSpeed release that adds one fails :func:`test_the_table_covers_exactly_deepspeeds_abstract_interface`
until the kit specifies it. Each check derives what it expects from the plugin's own declarations (its device
type and count, traits, backend, kernels), so the table holds for any device.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed", reason="the accelerator table needs DeepSpeed (devshim-core[deepspeed])")
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator  # noqa: E402

from devshim_core.errors import DevshimError  # noqa: E402

ABSTRACT = frozenset(DeepSpeedAccelerator.__abstractmethods__)
MiB = 1 << 20
Check = Callable[[Any, Any], None]  # (accelerator, device facade)


@pytest.fixture(scope="module")
def acc(devshim_device: Any) -> Any:
    accelerator = get_accelerator()
    assert getattr(accelerator, "_devshim_device", None) is devshim_device, (
        f"DeepSpeed's accelerator is {type(accelerator).__name__}, not devshim's for the plugin under test")
    return accelerator


@pytest.fixture(autouse=True)
def _rng_restored(devshim_device: Any) -> Any:
    host, device = torch.get_rng_state(), devshim_device.get_rng_state()
    yield
    torch.set_rng_state(host)
    devshim_device.set_rng_state(device)


def here(dev: Any) -> torch.device:
    return dev.torch_device(dev.current_device())


# -- execution model -----------------------------------------------------------------------------------------------

def execution_model(acc: Any, dev: Any, name: str) -> None:
    assert getattr(acc, name)() is dev.traits.host_synchronous


# -- device --------------------------------------------------------------------------------------------------------

def check_device_name(acc: Any, dev: Any) -> None:
    assert acc.device_name() == dev.type
    for index in range(dev.device_count()):
        assert acc.device_name(index) == dev.device_name(index)


def check_device(acc: Any, dev: Any) -> None:
    for index in range(dev.device_count()):
        assert acc.device(index) == dev.torch_device(index)
        assert torch.ones(1, device=acc.device(index)).device == dev.torch_device(index)


def check_set_device(acc: Any, dev: Any) -> None:
    original = acc.current_device()
    try:
        for index in range(dev.device_count()):
            acc.set_device(index)
            assert acc.current_device() == dev.current_device() == index
    finally:
        acc.set_device(original)


def check_current_device(acc: Any, dev: Any) -> None:
    index = acc.current_device()
    assert isinstance(index, int) and 0 <= index < acc.device_count()


def check_current_device_name(acc: Any, dev: Any) -> None:
    assert acc.current_device_name() == acc.device_name(acc.current_device())
    assert torch.zeros(1, device=acc.current_device_name()).device == here(dev)


def check_device_count(acc: Any, dev: Any) -> None:
    assert acc.device_count() == dev.device_count() >= 1


def check_synchronize(acc: Any, dev: Any) -> None:
    x = torch.arange(4.0, device=here(dev)) * 2
    assert acc.synchronize() is None and acc.synchronize(acc.current_device()) is None
    assert x.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


# -- RNG -----------------------------------------------------------------------------------------------------------

def _reproducible(seed: Callable[[int], None], dev: Any) -> None:
    seed(1234)
    first = torch.rand(8, device=here(dev)).cpu()
    seed(1234)
    assert torch.equal(torch.rand(8, device=here(dev)).cpu(), first)
    seed(4321)
    assert not torch.equal(torch.rand(8, device=here(dev)).cpu(), first)


def check_random(acc: Any, dev: Any) -> None:
    assert acc.random() is torch.random


def check_rng_state(acc: Any, dev: Any) -> None:
    index = acc.current_device()
    for state in (acc.get_rng_state(), acc.get_rng_state(index)):
        assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8
    state = acc.get_rng_state(index)
    draw = torch.rand(5, device=here(dev)).cpu()
    acc.set_rng_state(state, index)
    assert torch.equal(torch.rand(5, device=here(dev)).cpu(), draw)


def check_manual_seed(acc: Any, dev: Any) -> None:
    _reproducible(acc.manual_seed, dev)


def check_manual_seed_all(acc: Any, dev: Any) -> None:
    _reproducible(acc.manual_seed_all, dev)


def check_initial_seed(acc: Any, dev: Any) -> None:
    acc.manual_seed(2024)
    assert acc.initial_seed() == 2024


def check_default_generator(acc: Any, dev: Any) -> None:
    generator = acc.default_generator(acc.current_device())
    assert isinstance(generator, torch.Generator)
    acc.manual_seed(77)
    assert generator.initial_seed() == 77


# -- streams and events --------------------------------------------------------------------------------------------

def check_stream_class(acc: Any, dev: Any) -> None:
    stream = acc.Stream()
    stream.wait_stream(acc.current_stream())
    with acc.stream(stream):
        y = torch.ones(3, device=here(dev)) + 1
    acc.current_stream().wait_stream(stream)
    assert y.cpu().tolist() == [2.0, 2.0, 2.0]


def check_stream_context(acc: Any, dev: Any) -> None:
    stream, outside = acc.Stream(), acc.current_stream()
    with acc.stream(stream):
        assert acc.current_stream() == stream
    assert acc.current_stream() == outside


def check_current_stream(acc: Any, dev: Any) -> None:
    stream = acc.current_stream()
    assert stream is not None and callable(stream.wait_stream)
    assert acc.current_stream(acc.current_device()) == stream


def check_default_stream(acc: Any, dev: Any) -> None:
    stream = acc.default_stream()
    assert stream is not None and callable(stream.wait_stream)
    assert acc.default_stream(acc.current_device()) == stream


def check_event_class(acc: Any, dev: Any) -> None:
    event = acc.Event()
    torch.ones(4, device=here(dev)).sum()
    event.record()
    event.synchronize()
    assert event.query() is True


# -- memory --------------------------------------------------------------------------------------------------------

def _counter(read: Callable[..., int], dev: Any) -> None:
    assert isinstance(read(), int) and read() >= 0
    assert isinstance(read(dev.current_device()), int)


def peak(current_name: str, peak_name: str, reset_name: str) -> Check:
    """The peak follows a 64 MiB device allocation that is gone again; a reset forgets it."""
    def check(acc: Any, dev: Any) -> None:
        current, peak, reset = getattr(acc, current_name), getattr(acc, peak_name), getattr(acc, reset_name)
        reset()
        baseline = current()
        block = torch.ones(64 * MiB // 4, device=here(dev))
        grown = current()
        assert grown - baseline >= 32 * MiB, f"a 64 MiB block moved {current_name} by {grown - baseline} bytes"
        del block
        acc.empty_cache()  # a caching allocator keeps the block reserved until asked
        assert peak() >= grown
        reset()
        assert current() <= peak() < grown, (current(), peak(), grown)
    return check


def counter(name: str) -> Check:
    return lambda acc, dev: _counter(getattr(acc, name), dev)


def check_empty_cache(acc: Any, dev: Any) -> None:
    assert acc.empty_cache() is None


def check_memory_stats(acc: Any, dev: Any) -> None:
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] >= 0


def check_total_memory(acc: Any, dev: Any) -> None:
    assert acc.total_memory() >= acc.available_memory() > 0
    assert acc.total_memory() == dev.total_memory(dev.current_device())


def check_available_memory(acc: Any, dev: Any) -> None:
    assert 0 < acc.available_memory() <= acc.total_memory()


# -- dtypes --------------------------------------------------------------------------------------------------------

def dtype_support(dtype: torch.dtype, trait: str) -> Check:
    def check(acc: Any, dev: Any) -> None:
        name = {torch.bfloat16: "is_bf16_supported", torch.float16: "is_fp16_supported"}[dtype]
        assert getattr(acc, name)() is getattr(dev.traits, trait)
        if getattr(dev.traits, trait):
            assert (torch.ones(2, dtype=dtype, device=here(dev)) * 3).cpu().tolist() == [3.0, 3.0]
    return check


def check_supported_dtypes(acc: Any, dev: Any) -> None:
    assert list(acc.supported_dtypes()) == list(dev.traits.supported_dtypes)


# -- misc ----------------------------------------------------------------------------------------------------------

def check_is_available(acc: Any, dev: Any) -> None:
    assert acc.is_available() is True


def check_ranges(acc: Any, dev: Any) -> None:
    """Ranges show up, nested, in the PyTorch profiler; an unmatched pop is ignored, as NVTX does."""
    with torch.profiler.profile() as profile:
        acc.range_push("devshim-kit-outer")
        acc.range_push("devshim-kit-inner")
        acc.range_pop()
        acc.range_pop()
    acc.range_pop()
    names = {event.name for event in profile.events()}
    assert {"devshim-kit-outer", "devshim-kit-inner"} <= names


def check_lazy_call(acc: Any, dev: Any) -> None:
    calls: list[str] = []

    def call() -> str:
        calls.append("called")
        return "result"

    assert acc.lazy_call(call) == "result" and calls == ["called"]


def check_communication_backend_name(acc: Any, dev: Any) -> None:
    assert acc.communication_backend_name() == dev.collectives.backend


def check_is_triton_supported(acc: Any, dev: Any) -> None:
    assert acc.is_triton_supported() is False  # devshim serves no triton backend for its devices


def graph_refused(call: Callable[[Any], Any]) -> Check:
    """Refused with a DevshimError naming the device: a graph that captured nothing would replay stale outputs."""
    def check(acc: Any, dev: Any) -> None:
        with pytest.raises(DevshimError, match=f"device graph.*{dev.type}"):
            call(acc)
    return check


def tensor_type(name: str, dtype: torch.dtype) -> Check:
    def check(acc: Any, dev: Any) -> None:
        expected = torch.int32 if dtype == torch.int64 and not dev.traits.int64_supported else dtype
        made = getattr(acc, name)([1, 2, 3])
        assert made.dtype == expected and made.device == here(dev), (made.dtype, made.device)
        assert made.cpu().tolist() == [1, 2, 3]
    return check


def check_on_accelerator(acc: Any, dev: Any) -> None:
    assert acc.on_accelerator(torch.ones(1, device=here(dev))) is True
    assert acc.on_accelerator(torch.empty(1, device="meta")) is False


def check_op_builder_dir(acc: Any, dev: Any) -> None:
    package = importlib.import_module(acc.op_builder_dir())
    assert hasattr(package, "FusedAdamBuilder") and hasattr(package, "CPUAdamBuilder")


def check_create_op_builder(acc: Any, dev: Any) -> None:
    """DeepSpeed's Adam ops load devshim's builders, which load the plugin's kernels and compile nothing; a
    kernel the plugin lacks makes the builder refuse, naming the plugin."""
    for builder, kernel in (("FusedAdamBuilder", dev.optimizer.fused_adamw), ("CPUAdamBuilder",
                                                                             dev.optimizer.host_adam_step)):
        made = acc.create_op_builder(builder)
        assert made is not None, builder
        if kernel is None:  # refused as DeepSpeed refuses an op it cannot build: a RuntimeError naming the plugin
            with pytest.raises(RuntimeError, match=f"devshim plugin {dev.plugin!r}"):
                made.load()
        else:
            assert made.load() is not None


def check_get_op_builder(acc: Any, dev: Any) -> None:
    assert isinstance(acc.create_op_builder("FusedAdamBuilder"), acc.get_op_builder("FusedAdamBuilder"))


def check_build_extension(acc: Any, dev: Any) -> None:
    from torch.utils.cpp_extension import BuildExtension

    assert acc.build_extension() is BuildExtension


def check_export_envs(acc: Any, dev: Any) -> None:
    prefixes = acc.export_envs()
    assert "DEVSHIM" in prefixes and set(dev.collectives.export_env_prefixes) <= set(prefixes)


def check_visible_devices_envs(acc: Any, dev: Any) -> None:
    names = acc.visible_devices_envs()
    assert names and all(isinstance(n, str) and n for n in names)
    assert list(dev.collectives.visible_devices_envs) in ([], names)


def check_set_visible_devices_envs(acc: Any, dev: Any) -> None:
    env = {"UNRELATED": "kept"}
    acc.set_visible_devices_envs(env, [0, 2, 3])
    assert env == {"UNRELATED": "kept", **dict.fromkeys(acc.visible_devices_envs(), "0,2,3")}


def check_compile_backend(acc: Any, dev: Any) -> None:
    original = acc.get_compile_backend()
    assert original in torch._dynamo.list_backends(exclude_tags=())
    try:
        acc.set_compile_backend("eager")
        assert acc.get_compile_backend() == "eager"
        with pytest.raises(ValueError, match=r"not a torch\.compile backend"):
            acc.set_compile_backend("no-such-backend")
    finally:
        acc.set_compile_backend(original)


def plain(check: Check) -> Callable[[Any, Any, str], None]:
    return lambda acc, dev, name: check(acc, dev)


EXPECTED: dict[str, Callable[[Any, Any, str], None]] = {
    **dict.fromkeys(("is_synchronized_device", "use_host_timers", "resolves_data_dependency",
                     "handles_memory_backpressure"), execution_model),
    "device_name": plain(check_device_name),
    "device": plain(check_device),
    "set_device": plain(check_set_device),
    "current_device": plain(check_current_device),
    "current_device_name": plain(check_current_device_name),
    "device_count": plain(check_device_count),
    "synchronize": plain(check_synchronize),
    "random": plain(check_random),
    "set_rng_state": plain(check_rng_state),
    "get_rng_state": plain(check_rng_state),
    "manual_seed": plain(check_manual_seed),
    "manual_seed_all": plain(check_manual_seed_all),
    "initial_seed": plain(check_initial_seed),
    "default_generator": plain(check_default_generator),
    "Stream": plain(check_stream_class),
    "stream": plain(check_stream_context),
    "current_stream": plain(check_current_stream),
    "default_stream": plain(check_default_stream),
    "Event": plain(check_event_class),
    "empty_cache": plain(check_empty_cache),
    "memory_allocated": plain(counter("memory_allocated")),
    "memory_cached": plain(counter("memory_cached")),
    "memory_reserved": plain(counter("memory_reserved")),
    "max_memory_allocated": plain(peak("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")),
    "reset_max_memory_allocated": plain(peak("memory_allocated", "max_memory_allocated",
                                             "reset_max_memory_allocated")),
    "max_memory_cached": plain(peak("memory_cached", "max_memory_cached", "reset_max_memory_cached")),
    "reset_max_memory_cached": plain(peak("memory_cached", "max_memory_cached", "reset_max_memory_cached")),
    "reset_peak_memory_stats": plain(peak("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")),
    "max_memory_reserved": plain(peak("memory_reserved", "max_memory_reserved", "reset_peak_memory_stats")),
    "memory_stats": plain(check_memory_stats),
    "total_memory": plain(check_total_memory),
    "available_memory": plain(check_available_memory),
    "is_bf16_supported": plain(dtype_support(torch.bfloat16, "bf16_supported")),
    "is_fp16_supported": plain(dtype_support(torch.float16, "fp16_supported")),
    "supported_dtypes": plain(check_supported_dtypes),
    "is_available": plain(check_is_available),
    "range_push": plain(check_ranges),
    "range_pop": plain(check_ranges),
    "lazy_call": plain(check_lazy_call),
    "communication_backend_name": plain(check_communication_backend_name),
    "is_triton_supported": plain(check_is_triton_supported),
    "create_graph": plain(graph_refused(lambda acc: acc.create_graph())),
    "capture_to_graph": plain(graph_refused(lambda acc: acc.capture_to_graph(object()))),
    "replay_graph": plain(graph_refused(lambda acc: acc.replay_graph(object()))),
    **{name: plain(tensor_type(name, dtype)) for name, dtype in (
        ("BFloat16Tensor", torch.bfloat16), ("ByteTensor", torch.uint8), ("DoubleTensor", torch.float64),
        ("FloatTensor", torch.float32), ("HalfTensor", torch.float16), ("IntTensor", torch.int32),
        ("LongTensor", torch.int64))},
    "on_accelerator": plain(check_on_accelerator),
    "op_builder_dir": plain(check_op_builder_dir),
    "create_op_builder": plain(check_create_op_builder),
    "get_op_builder": plain(check_get_op_builder),
    "build_extension": plain(check_build_extension),
    "export_envs": plain(check_export_envs),
    "visible_devices_envs": plain(check_visible_devices_envs),
    "set_visible_devices_envs": plain(check_set_visible_devices_envs),
    "get_compile_backend": plain(check_compile_backend),
    "set_compile_backend": plain(check_compile_backend),
}


def test_the_table_covers_exactly_deepspeeds_abstract_interface() -> None:
    assert sorted(ABSTRACT - EXPECTED.keys()) == [], "abstract methods the kit does not specify"
    assert sorted(EXPECTED.keys() - ABSTRACT) == [], "expectations for names DeepSpeed no longer declares"


@pytest.mark.parametrize("name", sorted(ABSTRACT))
def test_the_accelerator_method_behaves_as_declared(acc: Any, devshim_device: Any, name: str) -> None:
    check = EXPECTED.get(name)
    if check is None:
        pytest.fail(f"DeepSpeedAccelerator.{name} has no expected behaviour in the kit")
    check(acc, devshim_device, name)
