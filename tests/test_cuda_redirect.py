"""Spec: with the CUDA redirect on (the selected device is not CUDA), a CUDA-written script runs unmodified on the
selected device -- here the CPU, through the ``cpu_reference`` plugin.

One section per table of ``devshim_core.integrations.cuda_redirect.coverage``: what each name does once devshim is
activated (``CLASSES`` and ``STORAGE_METHODS``, which serve checkpoints, are specified with ``torch.load`` and
``torch.save`` in ``tests/test_cuda_checkpoints.py``). Each spec activates devshim in this pytest process
(``DEVSHIM_PLUGIN=cpu_reference`` with two device slots, the DeepSpeed and Megatron integrations off so that only the
redirect is under test), and leaves the process as it found it (the suite's own session, if there was one, is
activated again). This torch has no CUDA: every ``'cuda'`` below would raise without the redirect.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from plugin_fixtures import DEVSHIM_SCRIPT, PYTHON, checked_json, clean_env

from devshim_core import session
from devshim_core.device import Device
from devshim_core.integrations.cuda_redirect import coverage, wrappers
from devshim_core.integrations.cuda_redirect.device_map import DeviceMap
from devshim_core.patching import REGISTRY

ENV = {"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_PATCH_DEEPSPEED": "0", "DEVSHIM_PATCH_MEGATRON": "0"}
CPU = torch.device("cpu")
CUDA_SPECS = ["cuda", "cuda:1", torch.device("cuda", 1), 1]
CUDA_SPEC_IDS = ["'cuda'", "'cuda:1'", "torch.device('cuda',1)", "bare-1"]


# -- activation ----------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def activated(environ: dict[str, str] | None = None) -> Iterator[session.Session]:
    """devshim activated with ``environ`` (default :data:`ENV`) and two CPU device slots; afterwards the session
    this process had before (``import devshim_core.auto``'s, in the full suite) is activated again."""
    had_session = session.current() is not None
    session.deactivate()
    try:
        with pytest.MonkeyPatch.context() as mp:  # read once, when the plugin detects its device
            mp.setenv("DEVSHIM_CPU_DEVICE_COUNT", "2")
            active = session.activate(ENV if environ is None else environ)
        yield active
    finally:
        session.deactivate()
        if had_session:
            session.activate()  # as `import devshim_core.auto` made it (same environment)


@pytest.fixture
def cuda() -> Iterator[Device]:
    """The redirect on; the device facade it answers from. The current device and the RNG are restored after."""
    rng = torch.get_rng_state()
    with activated() as active:
        yield active.device
        torch.cuda.set_device(0)
    torch.set_rng_state(rng)


@pytest.fixture
def quiet() -> Iterator[None]:
    """torch.cuda.amp's spellings are deprecated: their FutureWarnings are not what these specs are about."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- every name the tables cover, read without side effects ---------------------------------------------------------

ABSENT = object()


def _own(owner: Any, name: str) -> Any:
    return vars(owner).get(name, ABSENT)


def covered_names() -> dict[str, Callable[[], Any]]:
    """'where.name' -> how to read it, for every name a coverage table lists (and the re-exports it patches)."""
    import torch.amp.autocast_mode
    import torch.amp.grad_scaler
    import torch.cuda.nvtx
    import torch.cuda.random
    import torch.distributed.distributed_c10d as c10d

    def read(owner: Any, name: str) -> Callable[[], Any]:
        return lambda: _own(owner, name)

    def attribute(owner: Any, name: str) -> Callable[[], Any]:  # inherited methods: what a lookup finds
        return lambda: getattr(owner, name, ABSENT)

    names: dict[str, Callable[[], Any]] = {}
    for name in coverage.DEVICE_FUNCTIONS | coverage.INTERNALS | set(coverage.TENSOR_TYPES):
        names[f"torch.cuda.{name}"] = read(torch.cuda, name)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "seed", "seed_all",
                 "initial_seed", "get_rng_state_all", "set_rng_state_all"):
        names[f"torch.cuda.random.{name}"] = read(torch.cuda.random, name)
    for name in coverage.NVTX_FUNCTIONS:
        names[f"torch.cuda.nvtx.{name}"] = read(torch.cuda.nvtx, name)
    for name in coverage.AMP_NAMES:
        names[f"torch.cuda.amp.{name}"] = read(torch.cuda.amp, name)
    for name in coverage.FACTORIES:
        names[f"torch.{name}"] = read(torch, name)
    for name in coverage.TENSOR_METHODS:
        names[f"torch.Tensor.{name}"] = attribute(torch.Tensor, name)
    for name in coverage.MODULE_METHODS:
        names[f"torch.nn.Module.{name}"] = attribute(torch.nn.Module, name)
    # coverage.CLASSES: torch.Generator is replaced by a subclass; UntypedStorage gets a __new__ of its own
    names["torch.Generator"] = read(torch, "Generator")
    names["torch.UntypedStorage.__new__"] = read(torch.UntypedStorage, "__new__")
    assert {"Generator", "UntypedStorage"} == coverage.CLASSES, "a class added to the table: read it here too"
    for name in coverage.STORAGE_METHODS:
        names[f"torch.storage._StorageBase.{name}"] = read(torch.storage._StorageBase, name)
    for name in coverage.DISTRIBUTED:
        names[f"torch.distributed.{name}"] = read(dist, name)
        names[f"torch.distributed.distributed_c10d.{name}"] = read(c10d, name)
    names["torch.amp.autocast_mode.autocast.__init__"] = attribute(torch.amp.autocast_mode.autocast, "__init__")
    names["torch.amp.grad_scaler.GradScaler.__init__"] = attribute(torch.amp.grad_scaler.GradScaler, "__init__")
    for name in ("custom_fwd", "custom_bwd"):
        names[f"torch.amp.{name}"] = read(torch.amp, name)
        names[f"torch.amp.autocast_mode.{name}"] = read(torch.amp.autocast_mode, name)
    return names


def snapshot() -> dict[str, Any]:
    return {where: read() for where, read in covered_names().items()}


@pytest.fixture
def pristine() -> Iterator[dict[str, Any]]:
    """Every covered name as torch defines it (read with devshim deactivated); the suite's session is back after."""
    had_session = session.current() is not None
    session.deactivate()
    try:
        yield snapshot()
    finally:
        if had_session and session.current() is None:
            session.activate()


# -- activation, switches and deactivation ---------------------------------------------------------------------------

def test_the_redirect_is_applied_when_the_selected_device_is_not_cuda(cuda):
    active = session.current()
    assert active.device.type == "cpu" and active.device.plugin == "cpu_reference"
    assert active.integrations["cuda-redirect"].startswith(
        "applied (run CUDA-written scripts on cpu (cpu_reference), native wrappers")
    assert REGISTRY.is_applied("cuda-redirect")


def test_deactivation_restores_every_name_the_tables_cover(pristine):
    with activated():
        during = snapshot()
    after = snapshot()
    replaced = {where for where in pristine if during[where] is not pristine[where]}
    # the deprecated torch.cuda.amp spellings are left alone: they reach the patched torch.amp underneath
    untouched = {f"torch.cuda.amp.{name}" for name in coverage.AMP_NAMES}
    assert replaced == set(pristine) - untouched
    assert [where for where in pristine if after[where] is not pristine[where]] == []


def no_device_functions() -> dict[str, Any]:
    return {"torch.add": torch.add, "torch.matmul": torch.matmul, "Tensor.add": torch.Tensor.add,
            "Tensor.sum": torch.Tensor.sum, "F.linear": torch.nn.functional.linear,
            "Module.train": torch.nn.Module.train, "Module.forward": torch.nn.Module.__call__}


def test_functions_that_take_no_device_are_the_very_same_objects(pristine):
    before = no_device_functions()  # devshim is off here (the fixture)
    with activated():
        now = no_device_functions()
    assert [name for name in before if now[name] is not before[name]] == []  # never wrapped: they cost the same


def test_devshim_redirect_cuda_0_leaves_torch_cuda_untouched(pristine):
    # the job-level torch.distributed sets wrap init_process_group too: off here, so only the redirect is in question
    with activated({**ENV, "DEVSHIM_REDIRECT_CUDA": "0", "DEVSHIM_PATCH_DISTRIBUTED": "0"}) as active:
        assert active.integrations["cuda-redirect"] == "skipped: DEVSHIM_REDIRECT_CUDA=0"
        assert not REGISTRY.is_applied("cuda-redirect")
        during = snapshot()
        assert torch.cuda.is_available() is False  # torch's own answer on this CUDA-less build
        with pytest.raises((AssertionError, RuntimeError), match="not compiled with CUDA"):
            torch.zeros(1, device="cuda")
    assert [where for where in pristine if during[where] is not pristine[where]] == []


def test_devshim_info_says_the_redirect_is_off_with_devshim_redirect_cuda_0():
    env = clean_env(DEVSHIM_PLUGIN="cpu_reference", DEVSHIM_REDIRECT_CUDA="0")
    report = checked_json(subprocess.run([DEVSHIM_SCRIPT, "info", "--json"], env=env, capture_output=True, text=True,
                                         timeout=120))
    assert report["integrations"]["cuda-redirect"] == "skipped: DEVSHIM_REDIRECT_CUDA=0"
    assert not [row for row in report["patches"] if row["set"] == "cuda-redirect"]


COPIES = """\
from torch import zeros
from torch.cuda import _lazy_call, manual_seed, FloatTensor
from torch.cuda.nvtx import range_push
import torch.cuda as cuda_alias
"""


def test_references_copied_before_activation_are_rebound_and_restored(pristine, tmp_path, monkeypatch):
    # Megatron does `from torch.cuda import _lazy_call` at import; a script may import it before devshim activates
    (tmp_path / "copies_made_before_devshim.py").write_text(COPIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "copies_made_before_devshim", raising=False)
    copies = importlib.import_module("copies_made_before_devshim")
    names = {"zeros": "torch.zeros", "_lazy_call": "torch.cuda._lazy_call", "manual_seed": "torch.cuda.manual_seed",
             "FloatTensor": "torch.cuda.FloatTensor", "range_push": "torch.cuda.nvtx.range_push"}
    try:
        assert all(getattr(copies, name) is pristine[where] for name, where in names.items())
        with activated():
            served = snapshot()
            assert all(getattr(copies, name) is served[where] for name, where in names.items())
            assert all(served[where] is not pristine[where] for where in names.values())
            assert copies.cuda_alias is torch.cuda  # a module is the same module: nothing to rebind
            ran = []
            copies._lazy_call(lambda: ran.append("seeded"))
            assert ran == ["seeded"]
        assert all(getattr(copies, name) is pristine[where] for name, where in names.items())
    finally:
        del sys.modules["copies_made_before_devshim"]


# -- torch.cuda: the device facade answers (coverage.DEVICE_FUNCTIONS) ------------------------------------------------

def test_availability_and_count_are_the_facades(cuda):
    assert torch.cuda.is_available() is True
    assert torch.cuda.device_count() == cuda.device_count() == 2
    assert torch.cuda.is_initialized() is True
    assert torch.cuda.init() is None
    torch.cuda._lazy_init()  # torch's internal CUDA initialisation: nothing to initialise


@pytest.mark.parametrize(("spec", "index"), [(1, 1), ("cuda:1", 1), (torch.device("cuda", 1), 1), ("cuda:0", 0),
                                             (torch.device("cuda", 0), 0)],
                         ids=["1", "'cuda:1'", "torch.device('cuda',1)", "'cuda:0'", "torch.device('cuda',0)"])
def test_set_device_takes_an_index_a_cuda_string_or_a_torch_device(cuda, spec, index):
    torch.cuda.set_device(1 - index)
    torch.cuda.set_device(spec)
    assert torch.cuda.current_device() == cuda.current_device() == index


def test_set_device_minus_one_is_a_no_op_and_the_device_context_restores_the_previous_index(cuda):
    torch.cuda.set_device(1)
    torch.cuda.set_device(-1)
    assert torch.cuda.current_device() == 1
    with torch.cuda.device("cuda:0"):
        assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == 1
    with torch.cuda.device(None):  # None and negative indices select nothing, as in CUDA
        assert torch.cuda.current_device() == 1
    assert isinstance(torch.cuda.device(0), torch.cuda.device)  # a class, as CUDA's: torch asks isinstance


def test_synchronize_returns_with_or_without_a_device(cuda):
    assert torch.cuda.synchronize() is None
    assert torch.cuda.synchronize("cuda:1") is None


def test_memory_functions_answer_from_the_plugins_allocator(cuda):
    assert torch.cuda.memory_allocated() == cuda.memory_allocated(0)
    assert torch.cuda.memory_allocated("cuda:0") == torch.cuda.memory_allocated(torch.device("cuda", 0))
    assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated() > 0  # the process's resident memory
    assert torch.cuda.memory_reserved() == cuda.memory_reserved(0)
    assert torch.cuda.memory_cached() == torch.cuda.memory_reserved()  # the old name of the same figure
    assert torch.cuda.max_memory_cached() == torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
    assert isinstance(torch.cuda.memory_stats(), dict)
    for reset in (torch.cuda.reset_peak_memory_stats, torch.cuda.reset_max_memory_allocated,
                  torch.cuda.reset_max_memory_cached):
        assert reset() is None
    assert torch.cuda.empty_cache() is None
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total == cuda.total_memory(0)


def test_device_properties_have_cudas_fields_and_name_no_cuda_architecture(cuda):
    props = torch.cuda.get_device_properties(0)
    assert props.name == torch.cuda.get_device_name() == cuda.traits.name
    assert props.total_memory == cuda.total_memory(0)
    assert (props.major, props.minor) == torch.cuda.get_device_capability() == (0, 0)  # arch-gated CUDA paths stay off
    assert props.multi_processor_count >= 1
    assert props.gcnArchName == ""  # read by torch's compile cache when torch.version.cuda is None
    assert torch.cuda.get_device_properties("cuda").uuid == "cpu-0"
    assert torch.cuda.get_device_properties(torch.device("cuda", 1)).uuid == "cpu-1"
    assert torch.cuda.is_bf16_supported() is cuda.traits.bf16_supported is True


def test_streams_and_events_have_cudas_api(cuda):
    side = torch.cuda.Stream()
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.ones(64, 64, device="cuda").sum()
        end.record()
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    side.wait_stream(torch.cuda.current_stream())
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    assert side.query() is True and torch.cuda.is_current_stream_capturing() is False
    assert torch.cuda.Stream(device="cuda:1") is not None
    torch.cuda.ipc_collect()


def test_a_stream_context_can_be_entered_again_as_megatrons_grad_buffers_do(cuda):
    # megatron.core.distributed.param_and_grad_buffer keeps torch.cuda.stream(comm) and enters it twice per sync
    side = torch.cuda.Stream()
    context = torch.cuda.stream(side)
    for _ in range(2):
        with context:
            assert torch.cuda.current_stream() is side
            with context:  # nested in itself too
                assert torch.cuda.current_stream() is side
            assert torch.cuda.current_stream() is side
        assert torch.cuda.current_stream() is torch.cuda.default_stream()


def test_set_stream_makes_a_stream_current_until_the_next_set_stream(cuda):
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    default = torch.cuda.default_stream()
    torch.cuda.set_stream(first)
    assert torch.cuda.current_stream() is first
    torch.cuda.set_stream(second)
    assert torch.cuda.current_stream() is second
    torch.cuda.set_stream(None)  # no-op, as in CUDA
    assert torch.cuda.current_stream() is second
    torch.cuda.set_stream(default)
    assert torch.cuda.current_stream() is default


# -- RNG -------------------------------------------------------------------------------------------------------------

def test_manual_seed_and_the_rng_state_round_trip_reproduce_draws(cuda):
    torch.cuda.manual_seed(1234)
    assert torch.cuda.initial_seed() == 1234
    state = torch.cuda.get_rng_state()
    first = torch.randn(8, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.randn(8, device="cuda"), first)
    torch.cuda.random.set_rng_state(state)  # Megatron calls the torch.cuda.random spelling
    assert torch.equal(torch.randn(8, device="cuda"), first)
    states = torch.cuda.get_rng_state_all()
    assert len(states) == 2
    again = torch.randn(8, device="cuda")
    torch.cuda.set_rng_state_all(states)
    assert torch.equal(torch.randn(8, device="cuda"), again)


def test_seed_all_and_manual_seed_all_reseed(cuda):
    torch.cuda.manual_seed_all(99)
    assert torch.cuda.initial_seed() == 99
    torch.cuda.seed()
    torch.cuda.seed_all()
    assert torch.cuda.initial_seed() != 99


def test_torch_manual_seed_seeds_cuda_through_the_redirect_without_recursing(cuda):
    generator = torch.manual_seed(77)  # torch.manual_seed calls torch.cuda.manual_seed_all: the facade, once
    assert generator is torch.default_generator
    assert torch.cuda.initial_seed() == torch.initial_seed() == 77


def test_lazy_call_runs_at_once(cuda):
    # CUDA queues it until initialisation; without CUDA that never comes and Megatron's seeds would be lost
    ran = []
    torch.cuda._lazy_call(lambda: ran.append("now"), seed_all=True)
    assert ran == ["now"]


def test_default_generators_are_the_devices(cuda):
    assert len(torch.cuda.default_generators) == 2
    assert torch.cuda.default_generators[0] is cuda.module.default_generators[0] is torch.default_generator
    torch.cuda.manual_seed(5)
    assert torch.cuda.default_generators[0].initial_seed() == 5


# -- factories (coverage.FACTORIES) ----------------------------------------------------------------------------------

FACTORY_CALLS: dict[str, Callable[[Any], torch.Tensor]] = {
    "empty": lambda d: torch.empty(2, device=d),
    "empty_like": lambda d: torch.empty_like(torch.ones(2), device=d),
    "empty_strided": lambda d: torch.empty_strided((2, 2), (2, 1), device=d),
    "zeros": lambda d: torch.zeros(2, device=d),
    "zeros_like": lambda d: torch.zeros_like(torch.ones(2), device=d),
    "ones": lambda d: torch.ones(2, device=d),
    "ones_like": lambda d: torch.ones_like(torch.ones(2), device=d),
    "full": lambda d: torch.full((2,), 3.0, device=d),
    "full_like": lambda d: torch.full_like(torch.ones(2), 3.0, device=d),
    "rand": lambda d: torch.rand(2, device=d),
    "rand_like": lambda d: torch.rand_like(torch.ones(2), device=d),
    "randn": lambda d: torch.randn(2, device=d),
    "randn_like": lambda d: torch.randn_like(torch.ones(2), device=d),
    "randint": lambda d: torch.randint(0, 5, (2,), device=d),
    "randint_like": lambda d: torch.randint_like(torch.ones(2), 5, device=d),
    "randperm": lambda d: torch.randperm(4, device=d),
    "arange": lambda d: torch.arange(4, device=d),
    "range": lambda d: torch.range(0, 3, device=d),
    "linspace": lambda d: torch.linspace(0, 1, 5, device=d),
    "logspace": lambda d: torch.logspace(0, 1, 5, device=d),
    "eye": lambda d: torch.eye(3, device=d),
    "tensor": lambda d: torch.tensor([1.0, 2.0], device=d),
    "as_tensor": lambda d: torch.as_tensor([1.0, 2.0], device=d),
    "asarray": lambda d: torch.asarray([1.0, 2.0], device=d),
    "scalar_tensor": lambda d: torch.scalar_tensor(1.0, device=d),
    "tril_indices": lambda d: torch.tril_indices(3, 3, device=d),
    "triu_indices": lambda d: torch.triu_indices(3, 3, device=d),
    "normal": lambda d: torch.normal(0.0, 1.0, size=(2,), device=d),
    # takes no device at all: wrapped like the others (it is in the table), answered unchanged
    "frombuffer": lambda d: torch.frombuffer(bytearray(8), dtype=torch.float32),
}


def test_every_factory_of_the_table_is_specified_here():
    assert set(FACTORY_CALLS) == coverage.FACTORIES - {"set_default_device"}


@pytest.mark.filterwarnings("ignore:torch.range is deprecated:UserWarning")
@pytest.mark.parametrize("spec", CUDA_SPECS, ids=CUDA_SPEC_IDS)
def test_factories_given_a_cuda_device_create_on_the_selected_device(cuda, spec):
    wrong = {name: call(spec).device for name, call in FACTORY_CALLS.items() if call(spec).device != CPU}
    assert wrong == {}


def test_set_default_device_cuda_selects_the_selected_device(cuda):
    torch.set_default_device("cuda")
    try:
        assert torch.zeros(1).device == CPU
    finally:
        torch.set_default_device(None)


def test_tensor_to_and_cuda_reach_the_selected_device(cuda):
    x = torch.ones(2)
    for moved in (x.to("cuda"), x.to(0), x.to("cuda:1"), x.to(device="cuda"), x.to(torch.device("cuda", 1)),
                  x.cuda(), x.cuda(1), x.cuda("cuda:1"), x.cuda(non_blocking=True)):
        assert moved.device == CPU
    half = x.to("cuda", torch.float16)
    assert (half.device, half.dtype) == (CPU, torch.float16)


def test_tensor_to_a_dtype_or_a_tensor_is_passed_through_untouched(cuda):
    x = torch.ones(2)
    assert x.to(torch.float16).dtype == torch.float16
    assert x.to(dtype=torch.float64).dtype == torch.float64
    assert x.to(torch.zeros(1, dtype=torch.int32)).dtype == torch.int32
    assert x.to("cpu") is x  # nothing to do: the same tensor, as torch answers


def test_tensor_new_factories_take_a_cuda_device(cuda):
    x = torch.ones(2)
    for made in (x.new_zeros(3, device="cuda"), x.new_ones(3, device="cuda:1"), x.new_empty(3, device=0),
                 x.new_full((3,), 2.0, device="cuda"), x.new_tensor([1.0], device=torch.device("cuda"))):
        assert made.device == CPU


def test_module_cuda_and_to_move_the_model(cuda):
    model = torch.nn.Linear(2, 2)
    assert model.cuda() is model and model.weight.device == CPU
    assert model.cuda(1).weight.device == CPU
    assert model.to("cuda").weight.device == CPU
    assert model.to(torch.device("cuda", 1), torch.float64).weight.dtype == torch.float64
    assert model.to(torch.float32).weight.dtype == torch.float32
    empty = torch.nn.Linear(2, 2, device="meta").to_empty(device="cuda")
    assert empty.weight.device == CPU


# -- legacy tensor types (coverage.TENSOR_TYPES) ---------------------------------------------------------------------

@pytest.mark.parametrize(("name", "dtype"), sorted(coverage.TENSOR_TYPES.items()))
def test_each_cuda_tensor_type_constructs_checks_and_is_reported_on_the_device(cuda, name, dtype):
    cls = getattr(torch.cuda, name)
    made = cls([1, 0])
    assert (made.device, made.dtype, made.tolist()) == (CPU, getattr(torch, dtype), [1, 0])
    assert isinstance(made, cls)
    assert made.type() == f"torch.cuda.{name}"
    assert torch.ones(2).type(f"torch.cuda.{name}").dtype == getattr(torch, dtype)
    assert torch.ones(2).type(cls).dtype == getattr(torch, dtype)


def test_cuda_tensor_type_constructors_take_sizes_and_isinstance_checks_the_dtype(cuda):
    assert torch.cuda.FloatTensor(2, 3).shape == (2, 3)
    assert isinstance(torch.ones(2), torch.cuda.FloatTensor)
    assert not isinstance(torch.ones(2), torch.cuda.HalfTensor)
    assert not isinstance([1.0], torch.cuda.FloatTensor)


def test_tensor_type_to_a_dtype_or_a_host_type_name_is_torchs(cuda):
    x = torch.ones(2)
    assert x.type(torch.float64).dtype == torch.float64
    assert x.type("torch.DoubleTensor").dtype == torch.float64


# -- autocast and GradScaler (coverage.AMP_NAMES, AMP_DEVICE_TYPE) ---------------------------------------------------

def test_autocast_cuda_autocasts_on_the_device_in_float16(cuda):
    model = torch.nn.Linear(4, 4)
    with torch.autocast("cuda"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        assert model(torch.ones(1, 4)).dtype == torch.float16
    assert not torch.is_autocast_enabled("cpu")
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):  # a dtype the script names is kept
        assert model(torch.ones(1, 4)).dtype == torch.bfloat16


def test_cuda_amp_autocast_defaults_to_float16(cuda, quiet):
    with torch.cuda.amp.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    with torch.cuda.amp.autocast(enabled=False):
        assert not torch.is_autocast_enabled("cpu")


def test_grad_scaler_defaults_to_the_device(cuda, quiet):
    for scaler in (torch.amp.GradScaler(), torch.amp.GradScaler("cuda"), torch.amp.GradScaler(device="cuda"),
                   torch.cuda.amp.GradScaler(init_scale=1024.0)):
        assert scaler._device == "cpu"
    assert torch.cuda.amp.GradScaler(init_scale=1024.0).scale(torch.ones(1)).item() == 1024.0


def test_custom_fwd_reads_the_devices_autocast_state(cuda, quiet):
    class Double(torch.autograd.Function):
        @staticmethod
        @torch.cuda.amp.custom_fwd(cast_inputs=torch.float16)
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            ctx.autocast_inside = torch.is_autocast_enabled("cpu")
            return a * 2

        @staticmethod
        @torch.cuda.amp.custom_bwd
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    a = torch.ones(2, requires_grad=True)
    with torch.autocast("cuda"):
        out = Double.apply(a)
    assert out.dtype == torch.float16  # cast_inputs applied: the device's autocast was on
    out.float().sum().backward()
    assert a.grad.tolist() == [2.0, 2.0]


# -- NVTX (coverage.NVTX_FUNCTIONS) ----------------------------------------------------------------------------------

def test_nvtx_ranges_become_profiler_ranges(cuda):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert torch.cuda.nvtx.range_push("devshim-pushed") == 0
        torch.ones(4).sum()
        assert torch.cuda.nvtx.range_pop() == 0
        with torch.cuda.nvtx.range("devshim-{}", "context"):
            torch.ones(4).sum()
        torch.cuda.nvtx.mark("devshim-mark")
    names = {event.name for event in prof.events()}
    assert {"devshim-pushed", "devshim-context", "devshim-mark"} <= names
    assert torch.cuda.nvtx.range_pop() == -1  # nothing open: CUDA's answer


# -- torch.distributed (coverage.DISTRIBUTED) ------------------------------------------------------------------------

@pytest.fixture
def world(cuda) -> Iterator[None]:
    """A one-rank world over a free TCP port, started as a CUDA script starts it."""
    assert not dist.is_initialized()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))  # CUDA's eager init: dropped, no such device
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_init_process_group_nccl_gets_the_plugins_backend(world):
    assert dist.get_backend() == "gloo"
    t = torch.ones(2, device="cuda")
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]


def test_new_group_nccl_gets_the_plugins_backend(world):
    assert dist.get_backend(dist.new_group([0], backend="nccl")) == "gloo"
    assert dist.get_backend(dist.distributed_c10d.new_group([0], None, "nccl")) == "gloo"  # positional
    group, _ = dist.new_subgroups(group_size=1, backend="nccl")
    assert dist.get_backend(group) == "gloo"
    group, _ = dist.new_subgroups_by_enumeration([[0]], backend="nccl")
    assert dist.get_backend(group) == "gloo"


def test_gather_and_scatter_read_their_buffers_flat_as_nccl_does(world):
    # megatron's gather_split_1d_tensor: a [2, 4] shard gathered into a flat buffer (gloo alone: "invalid size")
    shard = torch.arange(8.0, device="cuda").reshape(2, 4)
    gathers = [dist.all_gather_into_tensor, dist.distributed_c10d.all_gather_into_tensor, dist._all_gather_base]
    for gather in [*gathers, getattr(dist, "all_gather_single", dist.all_gather_into_tensor)]:
        flat = torch.empty(8, device="cuda")
        gather(flat, shard)
        assert flat.tolist() == list(range(8))
    stacked = torch.empty(1, 2, 4, device="cuda")  # torch's stacked form for all_gather_into_tensor
    dist.all_gather_into_tensor(stacked, shard)
    assert torch.equal(stacked[0], shard)
    for scatter in (dist.reduce_scatter_tensor, getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)):
        out = torch.empty(2, 4, device="cuda")
        scatter(out, torch.arange(8.0, device="cuda"))  # gloo alone aborts the process here (a CHECK)
        assert torch.equal(out, shard)


# -- the wrappers: native and Python, one specification -------------------------------------------------------------
# The hot wrappers are compiled C (wrappers._native) when devshim-core was installed with a compiler, and Python
# otherwise. Both are held to the same table: what reaches the original, for each way a call can name a device.

IMPLEMENTATIONS = [pytest.param(True, id="native"), pytest.param(False, id="python")]


def echo(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def test_the_redirect_was_installed_with_its_native_wrappers(cuda):
    import pickle

    # devshim-core's install compiles them (setup.py); this fails if a build breaks and the fallback hides it
    assert wrappers.IMPLEMENTATION == "native"
    assert type(torch.empty).__name__ == "DeviceArgument" and type(torch.Tensor.to).__name__ == "DeviceArgument"
    assert torch.empty.__devshim_original__(0).device == CPU
    assert pickle.loads(pickle.dumps(torch.zeros)) is torch.zeros  # by name: a pickled function unpickles patched


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_a_device_keyword_is_mapped_and_everything_else_reaches_the_original_as_given(cuda, native):
    call = wrappers.device_keyword(echo, DeviceMap(cuda), native=native)
    one = cuda.torch_device(1)
    current = cuda.torch_device(0)
    assert call(1, 2) == ((1, 2), {})
    assert call(1, device="cuda:1", dtype=torch.half) == ((1,), {"device": one, "dtype": torch.half})
    assert call(device=torch.device("cuda", 1)) == ((), {"device": one})
    assert call(device=1) == ((), {"device": one})
    assert call(device="cuda") == ((), {"device": current})
    for untouched in ("cpu", "meta", torch.device("cpu"), None, [1]):  # [1]: unhashable, torch's to refuse
        assert call(device=untouched) == ((), {"device": untouched})
    many = {f"k{i}": i for i in range(20)}  # more arguments than the native fast buffer holds
    assert call(*range(5), **many, device="cuda:1") == (tuple(range(5)), {**many, "device": one})
    assert call("cuda") == (("cuda",), {})  # a positional 'cuda' is a size or data here, never a device


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_to_maps_a_leading_device_a_device_keyword_and_leaves_dtypes_and_tensors(cuda, native):

    class Box:
        to = wrappers.method_to(echo, DeviceMap(cuda), native=native)

    box, other = Box(), torch.zeros(1)
    one = cuda.torch_device(1)
    assert box.to("cuda:1", torch.half) == ((box, one, torch.half), {})
    assert box.to(1, non_blocking=True) == ((box, one), {"non_blocking": True})
    assert box.to(torch.device("cuda", 1)) == ((box, one), {})
    assert box.to(device="cuda:1", dtype=torch.half) == ((box,), {"device": one, "dtype": torch.half})
    assert box.to(torch.half) == ((box, torch.half), {})
    assert box.to(other, device="cuda:1") == ((box, other), {"device": "cuda:1"})  # torch's own to refuse
    assert Box.to(box, "cuda:1") == ((box, one), {})  # unbound, through the class
    bound = box.to  # an attribute read binds, as a function would
    assert bound("cuda:1") == ((box, one), {})


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_a_wrapper_reads_as_the_function_it_wraps_and_lets_its_errors_through(cuda, native):
    import inspect

    call = wrappers.device_keyword(echo, DeviceMap(cuda), native=native)
    assert (call.__name__, call.__wrapped__, call.__devshim_original__) == ("echo", echo, echo)
    assert inspect.signature(call) == inspect.signature(echo)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        wrappers.device_keyword(torch.nn.functional.relu, DeviceMap(cuda), native=native)(torch.ones(1), nope=1)


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_a_wrapper_holds_no_reference_it_does_not_own(cuda, native):
    import gc
    import weakref

    devices = DeviceMap(cuda)
    call = wrappers.device_keyword(echo, devices, native=native)
    spec = "cuda:1"
    call(device=spec)
    mapped = devices(spec)
    before = (sys.getrefcount(mapped), sys.getrefcount(spec), sys.getrefcount(echo))
    for _ in range(1000):
        call(device=spec)
        call(2, device=None)
    assert (sys.getrefcount(mapped), sys.getrefcount(spec), sys.getrefcount(echo)) == before
    alive = weakref.ref(devices)
    del call, devices
    gc.collect()
    assert alive() is None


TORCH_COMPILE_SCRIPT = """import sys
import devshim_core.auto  # the redirect on; torch._dynamo not imported yet, as in a fresh script
import torch

assert "torch._dynamo" not in sys.modules, "devshim imported torch._dynamo"


@torch.compile(fullgraph=True)  # a graph break is an error
def step(x):
    made = torch.ones(3, device="cuda") + x.new_zeros(3, device="cuda:1")
    return x.to("cuda").sin() + made


x = torch.arange(3.0)
print(torch.allclose(step(x), x.sin() + 1), step(x).device)
"""


def test_torch_compile_traces_native_wrappers_whole_when_dynamo_is_imported_after_devshim(tmp_path):
    script = tmp_path / "compiled.py"
    script.write_text(TORCH_COMPILE_SCRIPT)
    proc = subprocess.run([PYTHON, str(script)], env=clean_env(**ENV), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "cpu"]


# -- compilers -------------------------------------------------------------------------------------------------------

def test_torchscript_code_calling_a_factory_still_compiles(cuda):
    # TorchScript resolves torch.zeros by identity: the wrapper is registered as the same aten op
    @torch.jit.script
    def filled(n: int) -> torch.Tensor:
        return torch.zeros(n) + 1

    assert filled(3).tolist() == [1.0, 1.0, 1.0]


def test_torch_compile_works_under_the_redirect(cuda):
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def shifted(a: torch.Tensor) -> torch.Tensor:  # inductor reads torch.cuda.get_device_properties
        return a.sin() + torch.ones(3, device="cuda")

    try:
        x = torch.arange(3.0, device="cuda")
        assert torch.allclose(shifted(x), x.sin() + 1)
    finally:
        torch._dynamo.reset()


# -- a CUDA-written DeepSpeed script ---------------------------------------------------------------------------------

GETTING_STARTED = """\
import devshim_core.auto  # the only line added to a CUDA-written script

import argparse
import json

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--report", required=True)
args = parser.parse_args()

torch.cuda.set_device(args.local_rank)
deepspeed.init_distributed(dist_backend="nccl")
torch.manual_seed(0)
torch.cuda.manual_seed(0)

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).cuda()
config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

x = torch.randn(4, 8).to(engine.local_rank)
y = torch.randn(4, 1, device="cuda")
loss = torch.nn.functional.mse_loss(engine(x), y)
engine.backward(loss)
engine.step()
torch.cuda.synchronize()
with open(args.report, "w") as f:
    json.dump({"loss": loss.item(), "backend": torch.distributed.get_backend(), "input_device": str(x.device),
               "param_device": str(next(engine.module.parameters()).device), "steps": engine.global_steps,
               "max_memory_allocated": torch.cuda.max_memory_allocated()}, f)
"""


def test_a_cuda_written_deepspeed_script_trains_a_step_on_one_rank(tmp_path):
    script, report = tmp_path / "train.py", tmp_path / "report.json"
    script.write_text(GETTING_STARTED)
    env = clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                    TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))  # a JIT build would land there
    result = subprocess.run([PYTHON, str(script), "--report", str(report)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    answers = json.loads(report.read_text())
    assert answers["backend"] == "gloo"
    assert answers["input_device"] == answers["param_device"] == "cpu"
    assert answers["steps"] == 1
    assert answers["loss"] > 0 and answers["max_memory_allocated"] > 0
    assert not (tmp_path / "torch_extensions").exists() or not os.listdir(tmp_path / "torch_extensions")
