"""Spec: the CUDA redirect on the emulated vendor device: what a CUDA-written script names lands on ``npu`` (Ascend)
or ``tpu`` (Sophgo), on the index it names, with the device's own generator, autocast and collective backend.

Run once per vendor, in a process of its own (``DEVSHIM_EMULATE=ascend pytest tests/emulated``, then sophgo). The
main suite specifies every row of the redirect's coverage on the CPU (``tests/test_cuda_redirect.py``); here are
the essentials whose answer differs on an indexed device with its own RNG and backend. Each spec activates devshim
and deactivates it after, leaving the process as it found it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from devshim_core import session
from devshim_core.device import Device
from emulated.conftest import DEVICE_TYPE, VENDOR

BACKEND = {"ascend": "hccl", "sophgo": "sccl"}[VENDOR]


@pytest.fixture
def cuda(emulated_device: Any) -> Iterator[Device]:
    """The redirect on the emulated device; the current device index and the host RNG are restored after."""
    had_session = session.current() is not None
    session.deactivate()
    host_rng = torch.get_rng_state()
    try:
        active = session.activate()
        assert active.integrations["cuda-redirect"].startswith(f"applied (run CUDA-written scripts on {DEVICE_TYPE}")
        yield active.device
        torch.cuda.set_device(0)
    finally:
        torch.set_rng_state(host_rng)
        session.deactivate()
        if had_session:
            session.activate()


def on(index: int) -> torch.device:
    return torch.device(DEVICE_TYPE, index)


@pytest.mark.parametrize(("spec", "index"), [("cuda:1", 1), (torch.device("cuda", 1), 1), (1, 1), ("cuda", 0)],
                         ids=["'cuda:1'", "torch.device('cuda',1)", "bare-1", "'cuda'"])
def test_factories_land_on_the_device_index_they_name(cuda, spec, index):
    for made in (torch.zeros(2, device=spec), torch.randn(2, device=spec), torch.arange(3, device=spec),
                 torch.tensor([1.0], device=spec), torch.ones(2).to(spec), torch.ones(2).new_zeros(1, device=spec)):
        assert made.device == on(index)


def test_cuda_and_module_cuda_use_the_current_device_index(cuda):
    torch.cuda.set_device("cuda:1")
    assert torch.cuda.current_device() == getattr(torch, DEVICE_TYPE).current_device() == 1
    assert torch.ones(2).cuda().device == on(1)
    assert torch.zeros(1, device="cuda").device == on(1)  # no index: the current one, as CUDA does
    assert torch.nn.Linear(2, 2).cuda().weight.device == on(1)
    assert torch.ones(2).cuda(0).device == on(0)
    with torch.cuda.device(0):
        assert torch.ones(2).cuda().device == on(0)


def test_cuda_rng_functions_act_on_the_device_generator_not_the_hosts(cuda):
    device_module = getattr(torch, DEVICE_TYPE)
    host_state = torch.get_rng_state()
    torch.cuda.manual_seed(4321)
    assert torch.cuda.initial_seed() == device_module.initial_seed() == 4321
    assert torch.cuda.default_generators[0] is device_module.default_generators[0]
    state = torch.cuda.get_rng_state()
    assert torch.equal(state, device_module.get_rng_state())
    first = torch.randn(8, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.randn(8, device="cuda").cpu(), first.cpu())
    assert torch.equal(torch.get_rng_state(), host_state)  # the host generator never moved
    torch.cuda.set_device(1)
    assert torch.equal(torch.cuda.get_rng_state(), device_module.get_rng_state(1))  # the current index's


def test_lazy_call_runs_at_once_on_the_device(cuda):
    torch.cuda._lazy_call(lambda: torch.cuda.manual_seed(11))
    assert getattr(torch, DEVICE_TYPE).initial_seed() == 11


def test_cuda_tensor_types_are_tensors_on_the_device(cuda):
    made = torch.cuda.FloatTensor([1.0, 2.0])
    assert (made.device, made.dtype) == (on(0), torch.float32)
    assert isinstance(torch.ones(2, device="cuda"), torch.cuda.FloatTensor)
    assert not isinstance(torch.ones(2), torch.cuda.FloatTensor)  # a host tensor is not a device tensor
    assert not isinstance(torch.ones(2, device="cuda").half(), torch.cuda.FloatTensor)


def test_tensor_type_names_device_tensors_as_cuda_does(cuda):
    assert torch.ones(2, device="cuda").type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, device="cuda").bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type() == "torch.FloatTensor"  # the host keeps its own names
    assert torch.ones(2).type("torch.cuda.HalfTensor").device == on(0)
    # a device tensor keeps its index, as CUDA's Tensor.type does
    assert torch.ones(2, device="cuda:1").type("torch.cuda.HalfTensor").device == on(1)


def test_autocast_cuda_becomes_the_devices_autocast(cuda):
    model = torch.nn.Linear(4, 4).cuda()
    with torch.autocast("cuda"):
        assert torch.is_autocast_enabled(DEVICE_TYPE) and torch.get_autocast_dtype(DEVICE_TYPE) == torch.float16
        assert model(torch.ones(1, 4, device="cuda")).dtype == torch.float16
    assert not torch.is_autocast_enabled(DEVICE_TYPE)
    with pytest.warns(FutureWarning), torch.cuda.amp.autocast():
        assert torch.is_autocast_enabled(DEVICE_TYPE)
    assert torch.amp.GradScaler()._device == DEVICE_TYPE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nccl_becomes_the_vendors_backend(cuda):
    assert not dist.is_initialized()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        assert dist.get_backend() == BACKEND
        assert dist.get_backend(dist.new_group([0], backend="nccl")) == BACKEND
        t = torch.ones(2, device="cuda")
        dist.all_reduce(t)
        assert t.cpu().tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_cuda_event_and_stream_are_classes_that_recognise_what_they_make(cuda):
    # torch's own code asks isinstance(x, torch.cuda.Event) (its tensor extraction, run by every DDP all-reduce
    # future); the emulated torch.npu.Event, like a vendor's may be, is a function, which isinstance refuses
    assert isinstance(torch.cuda.Event, type) and isinstance(torch.cuda.Stream, type)
    assert not isinstance(object(), torch.cuda.Event)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    assert isinstance(start, torch.cuda.Event) and start.elapsed_time(end) >= 0
    assert isinstance(torch.cuda.Stream(), torch.cuda.Stream)
    assert torch.cuda.Stream().device == on(0)
