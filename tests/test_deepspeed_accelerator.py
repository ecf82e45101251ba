"""devshim's DeepSpeed accelerator on the CPU: every abstract method of DeepSpeed's interface, with real behaviour.

``EXPECTED`` holds one check per abstract method/property of
``deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator``; a DeepSpeed release that adds one fails
:func:`test_the_expectations_cover_exactly_deepspeeds_abstract_interface` until it is specified here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before deepspeed)
import deepspeed

# isort: on
import jit_watch
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

from devshim_core.errors import DevshimError
from devshim_core.integrations.deepspeed import op_builders as devshim_builders
from devshim_core.integrations.deepspeed.accelerator import DevshimAccelerator

ABSTRACT = frozenset(DeepSpeedAccelerator.__abstractmethods__)
MiB = 1 << 20


# -- no JIT compilation while this module runs ---------------------------------------------------------------------

jit_compilations = jit_watch.fixture()


@pytest.fixture
def acc() -> DevshimAccelerator:
    return get_accelerator()


@pytest.fixture(autouse=True)
def host_rng_restored():
    """Checks below reseed and redraw; leave the process's RNG as it was."""
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


# -- the accelerator itself ----------------------------------------------------------------------------------------

def test_get_accelerator_is_devshims_accelerator_for_the_cpu():
    accelerator = get_accelerator()
    assert isinstance(accelerator, DevshimAccelerator)
    assert isinstance(accelerator, DeepSpeedAccelerator)
    assert accelerator._name == "cpu"
    assert accelerator._devshim_device.plugin == "cpu_reference"
    assert get_accelerator() is accelerator  # one instance per process


def test_the_accelerator_class_leaves_no_abstract_method_unimplemented():
    assert DevshimAccelerator.__abstractmethods__ == frozenset()
    for name in ABSTRACT:
        assert getattr(DevshimAccelerator, name) is not getattr(DeepSpeedAccelerator, name), name


# -- one expected behaviour per abstract method --------------------------------------------------------------------

def _execution_model(answer: bool) -> Callable[[DevshimAccelerator, str], None]:
    def check(acc: DevshimAccelerator, name: str) -> None:
        assert getattr(acc, name)() is answer

    return check


def check_device_name(acc):
    assert acc.device_name() == "cpu"
    assert acc.device_name(0) == "cpu"  # a CPU has one torch device whatever the rank


def check_device(acc):
    assert acc.device(0) == torch.device("cpu")
    assert acc.device() == torch.device("cpu")
    assert torch.ones(2, device=acc.device(0)).device.type == "cpu"


def check_set_device(acc):
    original = acc.current_device()
    acc.set_device(0)
    assert acc.current_device() == 0
    acc.set_device(torch.device("cpu", 0))
    assert acc.current_device() == 0
    acc.set_device(original)


def check_current_device(acc):
    index = acc.current_device()
    assert isinstance(index, int) and 0 <= index < acc.device_count()


def check_current_device_name(acc):
    assert acc.current_device_name() == acc.device_name(acc.current_device()) == "cpu"
    assert torch.zeros(1, device=acc.current_device_name()).device.type == "cpu"


def check_device_count(acc):
    count = acc.device_count()
    assert isinstance(count, int) and count >= 1


def check_synchronize(acc):
    x = torch.arange(4.0) * 2
    assert acc.synchronize() is None
    assert acc.synchronize(0) is None
    assert x.tolist() == [0.0, 2.0, 4.0, 6.0]  # host-synchronous: results are there without waiting


def check_random(acc):
    assert acc.random() is torch.random
    acc.random().manual_seed(5)
    first = torch.rand(3)
    acc.random().manual_seed(5)
    assert torch.equal(torch.rand(3), first)


def check_rng_state_round_trip(acc):
    for index in (None, 0):
        state = acc.get_rng_state() if index is None else acc.get_rng_state(index)
        assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8
        draw = torch.rand(5)
        if index is None:
            acc.set_rng_state(state)
        else:
            acc.set_rng_state(state, index)
        assert torch.equal(torch.rand(5), draw)


def _check_seed_reproducibility(seed_function: Callable[[int], None]) -> None:
    seed_function(1234)
    first = torch.randn(8)
    seed_function(1234)
    assert torch.equal(torch.randn(8), first)
    seed_function(4321)
    assert not torch.equal(torch.randn(8), first)


def check_manual_seed(acc):
    _check_seed_reproducibility(acc.manual_seed)


def check_manual_seed_all(acc):
    _check_seed_reproducibility(acc.manual_seed_all)


def check_initial_seed(acc):
    acc.manual_seed(2024)
    assert acc.initial_seed() == 2024


def check_default_generator(acc):
    generator = acc.default_generator(0)
    assert isinstance(generator, torch.Generator) and generator.device.type == "cpu"
    acc.manual_seed(77)
    assert generator.initial_seed() == 77
    first = torch.rand(4, generator=generator)
    acc.manual_seed(77)
    assert torch.equal(torch.rand(4), first)  # it is the generator torch's CPU draws use


def check_stream_class(acc):
    stream = acc.Stream()
    stream.wait_stream(acc.current_stream())
    stream.wait_event(acc.Event())
    stream.record_event()
    with acc.stream(stream):
        y = torch.ones(3) + 1
    assert y.tolist() == [2.0, 2.0, 2.0]


def check_stream_context(acc):
    stream, outside = acc.Stream(), acc.current_stream()
    with acc.stream(stream):
        assert acc.current_stream() is stream
    assert acc.current_stream() is outside


def check_current_stream(acc):
    stream = acc.current_stream()
    assert stream is not None and callable(stream.wait_stream)
    assert acc.current_stream(0) is stream


def check_default_stream(acc):
    stream = acc.default_stream()
    assert stream is not None and callable(stream.wait_stream)
    assert acc.default_stream(0) is stream


def check_event_class(acc):
    event = acc.Event()
    event.record()
    event.record(acc.current_stream())
    event.wait()
    event.synchronize()
    assert event.query() is True  # work on a host-synchronous device is complete when recorded


def check_empty_cache(acc):
    assert acc.empty_cache() is None
    assert acc.memory_allocated() > 0


def _check_counter(read: Callable[..., int]) -> None:
    value = read()
    assert isinstance(value, int) and value > 0
    assert read(0) > 0


def _check_peak(read_current: Callable[..., int], read_peak: Callable[..., int], reset: Callable[..., None]) -> None:
    """The peak follows a 64 MiB allocation that is gone again, and reset brings it back down."""
    reset()
    baseline = read_current()
    block = torch.ones(64 * MiB // 4)  # filled, so its pages are really resident
    grown = read_current()
    assert grown - baseline >= 32 * MiB
    del block
    assert read_peak() >= grown
    assert read_current() < grown
    reset()
    assert read_peak() < grown
    assert read_peak() >= read_current()


def check_memory_allocated(acc):
    _check_counter(acc.memory_allocated)


def check_max_memory_allocated(acc):
    _check_peak(acc.memory_allocated, acc.max_memory_allocated, acc.reset_peak_memory_stats)


def check_reset_max_memory_allocated(acc):
    _check_peak(acc.memory_allocated, acc.max_memory_allocated, acc.reset_max_memory_allocated)


def check_memory_cached(acc):
    _check_counter(acc.memory_cached)


def check_max_memory_cached(acc):
    _check_peak(acc.memory_cached, acc.max_memory_cached, acc.reset_max_memory_cached)


def check_reset_max_memory_cached(acc):
    _check_peak(acc.memory_cached, acc.max_memory_cached, acc.reset_max_memory_cached)


def check_memory_stats(acc):
    stats = acc.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                "reserved_bytes.all.peak"):
        assert stats[key] > 0, key
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]


def check_reset_peak_memory_stats(acc):
    _check_peak(acc.memory_allocated, acc.max_memory_allocated, acc.reset_peak_memory_stats)


def check_memory_reserved(acc):
    _check_counter(acc.memory_reserved)


def check_max_memory_reserved(acc):
    _check_peak(acc.memory_reserved, acc.max_memory_reserved, acc.reset_peak_memory_stats)


def check_total_memory(acc):
    total = acc.total_memory()
    assert total >= acc.available_memory() > 0
    assert total > acc.memory_allocated()
    assert acc.total_memory(0) == total


def check_available_memory(acc):
    available = acc.available_memory()
    assert 0 < available <= acc.total_memory()
    assert acc.available_memory(0) > 0


def check_is_bf16_supported(acc):
    assert acc.is_bf16_supported() is True
    assert (torch.ones(2, dtype=torch.bfloat16, device=acc.device()) * 3).tolist() == [3.0, 3.0]


def check_is_fp16_supported(acc):
    assert acc.is_fp16_supported() is True
    assert (torch.ones(2, dtype=torch.float16, device=acc.device()) * 3).tolist() == [3.0, 3.0]


def check_supported_dtypes(acc):
    dtypes = acc.supported_dtypes()
    assert {torch.float32, torch.bfloat16, torch.float16} <= set(dtypes)
    assert all(isinstance(d, torch.dtype) for d in dtypes)


def check_is_available(acc):
    assert acc.is_available() is True


def check_range_push(acc):
    """Ranges show up, nested, in the PyTorch profiler; pushes and pops balance."""
    with torch.profiler.profile() as profile:
        acc.range_push("devshim-outer")
        acc.range_push("devshim-inner")
        torch.ones(4).sum()
        acc.range_pop()
        acc.range_pop()
    names = [event.name for event in profile.events()]
    assert "devshim-outer" in names and "devshim-inner" in names


def check_range_pop(acc):
    acc.range_push("devshim-range")
    acc.range_pop()
    acc.range_pop()  # an unmatched pop is ignored, as NVTX does
    with torch.profiler.profile() as profile:
        acc.range_push("devshim-after")
        acc.range_pop()
    assert "devshim-after" in [event.name for event in profile.events()]


def check_lazy_call(acc):
    calls = []
    result = acc.lazy_call(lambda: calls.append("called") or "result")
    assert calls == ["called"]  # the device is initialised already: nothing to defer
    assert result == "result"


def check_communication_backend_name(acc):
    assert acc.communication_backend_name() == "gloo"
    assert torch.distributed.is_gloo_available()  # the backend DeepSpeed will init_process_group with


def check_is_triton_supported(acc):
    assert acc.is_triton_supported() is False


GRAPH_REFUSAL = r"device graph \(CUDA-graph capture\), which devshim does not offer on cpu.*enable_cuda_graph=False"


def check_create_graph(acc):
    # refused: a graph that captured nothing would replay nothing (stale outputs, never an error)
    with pytest.raises(DevshimError, match=GRAPH_REFUSAL):
        acc.create_graph()


def check_capture_to_graph(acc):
    with pytest.raises(DevshimError, match=GRAPH_REFUSAL):
        acc.capture_to_graph(object())


def check_replay_graph(acc):
    with pytest.raises(DevshimError, match=GRAPH_REFUSAL):
        acc.replay_graph(object())


def test_an_inference_engine_asked_for_cuda_graphs_answers_each_input_never_a_stale_output():
    # DeepSpeed 0.19 captures only when its device is named 'cuda'; were it to ask, the accelerator refuses above
    model = torch.nn.Linear(4, 2)
    engine = deepspeed.init_inference(model, enable_cuda_graph=True, dtype=torch.float32)
    for x in (torch.ones(1, 4), torch.full((1, 4), 3.0)):
        torch.testing.assert_close(engine(x), model(x))


def _tensor_type(dtype: torch.dtype) -> Callable[[DevshimAccelerator, str], None]:
    def check(acc: DevshimAccelerator, name: str) -> None:
        tensor_type = getattr(acc, name)
        from_data = tensor_type([1, 2, 3])
        assert from_data.dtype == dtype and from_data.device.type == "cpu"
        assert from_data.tolist() == [1, 2, 3]
        empty = tensor_type(2, 3)
        assert empty.dtype == dtype and empty.shape == (2, 3)

    return check


def check_on_accelerator(acc):
    assert acc.on_accelerator(torch.ones(1)) is True
    assert acc.on_accelerator(torch.ones(1, dtype=torch.bfloat16)) is True
    assert acc.on_accelerator(torch.empty(1, device="meta")) is False


def check_op_builder_dir(acc):
    package = importlib.import_module(acc.op_builder_dir())
    assert package is devshim_builders
    assert package.CPUAdamBuilder is devshim_builders.CPUAdamBuilder


def check_create_op_builder(acc):
    assert isinstance(acc.create_op_builder("CPUAdamBuilder"), devshim_builders.CPUAdamBuilder)
    assert isinstance(acc.create_op_builder("FusedAdamBuilder"), devshim_builders.FusedAdamBuilder)
    assert isinstance(acc.create_op_builder("TransformerBuilder"), devshim_builders.NotImplementedBuilder)
    assert acc.create_op_builder("ShareMemCommBuilder") is None
    assert acc.create_op_builder("CCLCommBuilder") is None


def check_get_op_builder(acc):
    assert acc.get_op_builder("CPUAdamBuilder") is devshim_builders.CPUAdamBuilder
    assert acc.get_op_builder("FusedAdamBuilder") is devshim_builders.FusedAdamBuilder
    assert acc.get_op_builder("AsyncIOBuilder") is devshim_builders.AsyncIOBuilder
    gds = acc.get_op_builder("GDSBuilder")  # a refusal of its own, named for the op
    assert issubclass(gds, devshim_builders.NotImplementedBuilder) and gds().name == "gds"
    assert acc.get_op_builder("ShareMemCommBuilder") is None


def check_build_extension(acc):
    # setup.py's build command class for ahead-of-time builds; handing it out compiles nothing
    assert acc.build_extension() is torch.utils.cpp_extension.BuildExtension


def check_export_envs(acc):
    prefixes = acc.export_envs()
    assert "DEVSHIM" in prefixes
    assert all(isinstance(p, str) and p for p in prefixes)


def check_visible_devices_envs(acc):
    names = acc.visible_devices_envs()
    assert names and all(isinstance(n, str) and n for n in names)
    assert names[0] == "DEVSHIM_CPU_VISIBLE_DEVICES"


def check_set_visible_devices_envs(acc):
    env = {"UNRELATED": "kept"}
    acc.set_visible_devices_envs(env, [0, 2, 3])
    assert env == {"UNRELATED": "kept", **dict.fromkeys(acc.visible_devices_envs(), "0,2,3")}


def check_get_compile_backend(acc):
    backend = acc.get_compile_backend()
    assert backend == "inductor"
    assert backend in torch._dynamo.list_backends(exclude_tags=())


def check_set_compile_backend(acc):
    original = acc.get_compile_backend()
    try:
        acc.set_compile_backend("eager")
        assert acc.get_compile_backend() == "eager"
        with pytest.raises(ValueError, match=r"not a torch\.compile backend"):
            acc.set_compile_backend("no-such-backend")
        assert acc.get_compile_backend() == "eager"
    finally:
        acc.set_compile_backend(original)


def _plain(check: Callable[[DevshimAccelerator], None]) -> Callable[[DevshimAccelerator, str], None]:
    return lambda acc, name: check(acc)


EXPECTED: dict[str, Callable[[DevshimAccelerator, str], None]] = {
    # execution model: the CPU finishes work before a call returns
    "is_synchronized_device": _execution_model(True),
    "use_host_timers": _execution_model(True),
    "resolves_data_dependency": _execution_model(True),
    "handles_memory_backpressure": _execution_model(True),
    # device
    "device_name": _plain(check_device_name),
    "device": _plain(check_device),
    "set_device": _plain(check_set_device),
    "current_device": _plain(check_current_device),
    "current_device_name": _plain(check_current_device_name),
    "device_count": _plain(check_device_count),
    "synchronize": _plain(check_synchronize),
    # RNG
    "random": _plain(check_random),
    "set_rng_state": _plain(check_rng_state_round_trip),
    "get_rng_state": _plain(check_rng_state_round_trip),
    "manual_seed": _plain(check_manual_seed),
    "manual_seed_all": _plain(check_manual_seed_all),
    "initial_seed": _plain(check_initial_seed),
    "default_generator": _plain(check_default_generator),
    # streams and events
    "Stream": _plain(check_stream_class),
    "stream": _plain(check_stream_context),
    "current_stream": _plain(check_current_stream),
    "default_stream": _plain(check_default_stream),
    "Event": _plain(check_event_class),
    # memory
    "empty_cache": _plain(check_empty_cache),
    "memory_allocated": _plain(check_memory_allocated),
    "max_memory_allocated": _plain(check_max_memory_allocated),
    "reset_max_memory_allocated": _plain(check_reset_max_memory_allocated),
    "memory_cached": _plain(check_memory_cached),
    "max_memory_cached": _plain(check_max_memory_cached),
    "reset_max_memory_cached": _plain(check_reset_max_memory_cached),
    "memory_stats": _plain(check_memory_stats),
    "reset_peak_memory_stats": _plain(check_reset_peak_memory_stats),
    "memory_reserved": _plain(check_memory_reserved),
    "max_memory_reserved": _plain(check_max_memory_reserved),
    "total_memory": _plain(check_total_memory),
    "available_memory": _plain(check_available_memory),
    # dtypes
    "is_bf16_supported": _plain(check_is_bf16_supported),
    "is_fp16_supported": _plain(check_is_fp16_supported),
    "supported_dtypes": _plain(check_supported_dtypes),
    # misc
    "is_available": _plain(check_is_available),
    "range_push": _plain(check_range_push),
    "range_pop": _plain(check_range_pop),
    "lazy_call": _plain(check_lazy_call),
    "communication_backend_name": _plain(check_communication_backend_name),
    "is_triton_supported": _plain(check_is_triton_supported),
    # graphs
    "create_graph": _plain(check_create_graph),
    "capture_to_graph": _plain(check_capture_to_graph),
    "replay_graph": _plain(check_replay_graph),
    # legacy tensor types
    "BFloat16Tensor": _tensor_type(torch.bfloat16),
    "ByteTensor": _tensor_type(torch.uint8),
    "DoubleTensor": _tensor_type(torch.float64),
    "FloatTensor": _tensor_type(torch.float32),
    "HalfTensor": _tensor_type(torch.float16),
    "IntTensor": _tensor_type(torch.int32),
    "LongTensor": _tensor_type(torch.int64),
    # placement and op builders
    "on_accelerator": _plain(check_on_accelerator),
    "op_builder_dir": _plain(check_op_builder_dir),
    "create_op_builder": _plain(check_create_op_builder),
    "get_op_builder": _plain(check_get_op_builder),
    "build_extension": _plain(check_build_extension),
    # launch environment and compilation
    "export_envs": _plain(check_export_envs),
    "visible_devices_envs": _plain(check_visible_devices_envs),
    "set_visible_devices_envs": _plain(check_set_visible_devices_envs),
    "get_compile_backend": _plain(check_get_compile_backend),
    "set_compile_backend": _plain(check_set_compile_backend),
}


def test_the_expectations_cover_exactly_deepspeeds_abstract_interface():
    assert sorted(ABSTRACT - EXPECTED.keys()) == [], "abstract methods with no expected behaviour"
    assert sorted(EXPECTED.keys() - ABSTRACT) == [], "expectations for names DeepSpeed no longer declares"


@pytest.mark.parametrize("name", sorted(ABSTRACT))
def test_abstract_method_behaves_as_expected_on_the_cpu(acc, name):
    check = EXPECTED.get(name)
    if check is None:
        pytest.fail(f"DeepSpeedAccelerator.{name} has no expected behaviour in EXPECTED")
    check(acc, name)


def test_memory_counters_report_the_same_process_under_deepspeed_and_torch_names(acc):
    """DeepSpeed's older ``*_cached`` names are the ``*_reserved`` counters."""
    assert abs(acc.memory_cached() - acc.memory_reserved()) < 4 * MiB  # the resident set may move in between
    assert abs(acc.max_memory_cached() - acc.max_memory_reserved()) < 4 * MiB


# -- last: nothing above compiled anything -------------------------------------------------------------------------

def test_nothing_was_jit_compiled_while_this_module_ran(jit_compilations):
    jit_watch.assert_nothing_compiled(jit_compilations)
