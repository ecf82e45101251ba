"""Spec: checkpoints from a GPU cluster on the emulated vendor device -- ``npu`` (Ascend) or ``tpu`` (Sophgo), eight
devices -- where, unlike the CPU, each ``cuda:N`` has an index of its own and ``torch.save`` has a device to tag.

The fault injected is a checkpoint as two GPUs write it: ``{'a': on GPU 0, 'b': on GPU 1}``, its location strings
``cuda:0`` and ``cuda:1`` (``cuda_checkpoint_job.saved_on_gpu``; read back from the file), in torch's zip format and
its legacy one, plus one saved on a GPU this process does not have (``cuda:8``). What the user sees:

- ``torch.load`` puts each storage on the device index a CUDA machine would: the one it was saved on (no
  ``map_location``), the current one (``'cuda'``), the one named (``'cuda:1'``, ``torch.device``, a dict, a function
  calling ``storage.cuda(1)``), with the values the GPU saved; an index the process lacks is refused naming the file,
  the location and the device count, and saying which ``map_location`` to pass.
- ``torch.save`` of tensors on the device writes ``cuda:N``: a plain torch process (no devshim, no emulation) reads
  the file as it reads one from a GPU -- with ``map_location='cpu'`` the values, without it torch's CUDA deserializer
  claims it (a CUDA machine restores it to GPU N; this CPU-only one refuses as it refuses any GPU checkpoint). With
  that patch turned off (``DEVSHIM_DISABLE=cuda-redirect:checkpoint-save-as-cuda``) the vendor's ``npu:N`` is written,
  which no torch without the vendor's SDK can restore without a map_location.
- ``torch.Generator(device='cuda:1')``, ``torch.UntypedStorage(n, device='cuda:1')`` are the vendor's own, on index 1;
  ``torch.cuda.utilization()`` is refused naming the call (the emulated device reports no utilization).
- transformers' ``from_pretrained`` with a CUDA ``device_map`` (``'cuda'``, ``{'': 1}``, ``'auto'``) loads onto the
  device's indices.

Run once per vendor, in a process of its own (``DEVSHIM_EMULATE=ascend pytest tests/emulated``, then sophgo).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_checkpoint_job import run, saved_on_gpu, storage_locations

from devshim_core import session
from devshim_core.device import Device
from devshim_core.errors import DevshimError
from emulated.conftest import DEVICE_TYPE

A, B = torch.arange(4.0), torch.arange(4.0) * 10  # saved as if from GPU 0 and GPU 1
PLUGIN = {"npu": "ascend", "tpu": "sophgo"}[DEVICE_TYPE]


@contextlib.contextmanager
def activated(**switches: str) -> Iterator[Device]:
    """devshim activated on the emulated device, with ``switches`` added to the environment it reads; afterwards the
    current device index is 0 again and the process's own session, if it had one, is back."""
    had_session = session.current() is not None
    session.deactivate()
    try:
        active = session.activate({**os.environ, **switches})
        assert active.device.type == DEVICE_TYPE and active.device.device_count() == 8
        yield active.device
        torch.cuda.set_device(0)
    finally:
        session.deactivate()
        if had_session:
            session.activate()


@pytest.fixture
def cuda(emulated_device: Any) -> Iterator[Device]:
    with activated() as device:
        yield device


def on(index: int) -> torch.device:
    return torch.device(DEVICE_TYPE, index)


def on_gpus(storage: Any) -> int:
    return 1 if storage.data_ptr() == B.untyped_storage().data_ptr() else 0


@pytest.fixture(params=["zip", "legacy"])
def gpu_checkpoint(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"from_gpus_{request.param}.pt"
    with saved_on_gpu(on_gpus):
        torch.save({"a": A, "b": B}, path, _use_new_zipfile_serialization=request.param == "zip")
    if request.param == "zip":
        assert storage_locations(path) == ["cuda:0", "cuda:1"]
    return path


CURRENT = 1  # the current device while loading: 'cuda' with no index means it, as on CUDA
# map_location -> the device indices of ('a', 'b') after loading (None: the CPU)
MAP_LOCATIONS: dict[str, tuple[Any, tuple[int | None, int | None]]] = {
    "none": (None, (0, 1)),
    "'cuda'": ("cuda", (CURRENT, CURRENT)),
    "'cuda:0'": ("cuda:0", (0, 0)),
    "torch.device('cuda')": (torch.device("cuda"), (CURRENT, CURRENT)),
    "torch.device('cuda',0)": (torch.device("cuda", 0), (0, 0)),
    "dict-swapping-gpus": ({"cuda:0": "cuda:1", "cuda:1": "cuda:0"}, (1, 0)),
    "dict-to-gpu-5": ({"cuda:0": "cuda:5"}, (5, 1)),
    "storage.cuda()": (lambda storage, location: storage.cuda(), (CURRENT, CURRENT)),
    "storage.cuda(2)": (lambda storage, location: storage.cuda(2), (2, 2)),
    "storage.to('cuda:3')": (lambda storage, location: storage.to(device="cuda:3"), (3, 3)),
    "the-vendors-own-name": (f"{DEVICE_TYPE}:0", (0, 0)),
    "'cpu'": ("cpu", (None, None)),
}


@pytest.mark.parametrize(("map_location", "indices"), list(MAP_LOCATIONS.values()), ids=list(MAP_LOCATIONS))
def test_torch_load_puts_each_storage_where_a_cuda_machine_would(cuda, gpu_checkpoint, map_location, indices):
    torch.cuda.set_device(CURRENT)
    loaded = torch.load(gpu_checkpoint, map_location=map_location)
    expected = {name: torch.device("cpu") if i is None else on(i) for name, i in zip("ab", indices, strict=True)}
    assert {name: t.device for name, t in loaded.items()} == expected
    assert torch.equal(loaded["a"].cpu(), A) and torch.equal(loaded["b"].cpu(), B)


def test_a_gpu_index_the_process_lacks_is_refused_naming_the_file_and_the_map_location_to_pass(cuda, tmp_path):
    path = tmp_path / "from_gpu_8.pt"
    with saved_on_gpu(lambda storage: 8):  # rank 8 of a 16-GPU node; this process sees 8 devices
        torch.save({"a": A}, path)
    with pytest.raises(DevshimError) as refused:
        torch.load(path)
    assert str(refused.value) == (
        f"torch.load from {path}: a storage saved on 'cuda:8' cannot be restored on {DEVICE_TYPE}:8: this process "
        f"sees 8 {DEVICE_TYPE} device(s) (devshim plugin {PLUGIN}), and a CUDA machine with 8 GPU(s) refuses it the "
        "same way. Pass map_location to place it on a device this process has: map_location='cuda' (the current "
        "device), map_location={'cuda:8': 'cuda:0'} or map_location='cpu'.")
    loaded = torch.load(path, map_location={"cuda:8": "cuda:0"})  # what the message says works
    assert loaded["a"].device == on(0) and torch.equal(loaded["a"].cpu(), A)


def save_on_two_devices(path: Path) -> None:
    torch.save({"a": A.to("cuda:0"), "b": B.to("cuda:1")}, path)


def test_torch_save_on_the_device_writes_cuda_locations_that_load_back_here_and_as_from_a_gpu(cuda, tmp_path):
    path = tmp_path / "saved_on_the_device.pt"
    save_on_two_devices(path)
    assert storage_locations(path) == ["cuda:0", "cuda:1"]
    back = torch.load(path)
    assert (back["a"].device, back["b"].device) == (on(0), on(1))
    assert torch.equal(back["a"].cpu(), A) and torch.equal(back["b"].cpu(), B)

    refused = run(tmp_path, "plain-load", str(path))  # plain torch, no CUDA: as for any GPU's checkpoint
    assert refused["plain"] and refused["error"].startswith(
        "RuntimeError: Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False")
    mapped = run(tmp_path, "plain-load", str(path), "cpu")
    assert mapped["loaded"] == {"a": {"device": "cpu", "values": A.tolist()},
                                "b": {"device": "cpu", "values": B.tolist()}}


def test_with_save_as_cuda_turned_off_the_vendors_locations_need_a_map_location_elsewhere(emulated_device, tmp_path):
    path = tmp_path / "saved_with_vendor_locations.pt"
    with activated(DEVSHIM_DISABLE="cuda-redirect:checkpoint-save-as-cuda"):
        save_on_two_devices(path)
    assert storage_locations(path) == [f"{DEVICE_TYPE}:0", f"{DEVICE_TYPE}:1"]
    refused = run(tmp_path, "plain-load", str(path))
    assert refused["error"] == ("RuntimeError: don't know how to restore data location of "
                                f"torch.storage.UntypedStorage (tagged with {DEVICE_TYPE}:0)")


# -- the CUDA names on the way ---------------------------------------------------------------------------------------

def test_generator_on_cuda_is_the_vendors_generator_for_that_index(cuda):
    made = torch.Generator(device="cuda:1")
    assert made.device == torch.Generator(device=on(1)).device  # the vendor's answer (the emulator's is host RNG)
    assert isinstance(made, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    first = torch.randn(4, device="cuda:1", generator=made.manual_seed(3))
    assert first.device == on(1)
    assert torch.equal(torch.randn(4, device="cuda:1", generator=made.manual_seed(3)).cpu(), first.cpu())


def test_untyped_storage_on_cuda_is_allocated_on_the_index_named(cuda):
    assert torch.UntypedStorage(16, device="cuda:1").device == on(1)
    assert torch.UntypedStorage(16, device="cuda").device == on(0)
    assert torch.UntypedStorage(8).cuda(2).device == on(2)


def test_utilization_is_refused_naming_the_call_and_the_device(cuda):
    with pytest.raises(DevshimError, match=rf"^torch\.cuda\.utilization\(\) has no answer on {DEVICE_TYPE} "
                                           rf"\(devshim plugin {PLUGIN}\)"):
        torch.cuda.utilization()


def test_from_pretrained_with_a_cuda_device_map_puts_the_model_on_the_device(cuda, tmp_path):
    """transformers' ``device_map`` goes through Accelerate: ``'cuda'`` is the current device, ``'auto'`` spreads
    the modules over the devices the process sees (as over GPUs), ``{'': 1}`` is index 1; the logits are the saved
    model's."""
    pytest.importorskip("accelerate", reason="transformers' device_map needs accelerate (requirements-dev.txt)")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)).eval()
    model.save_pretrained(tmp_path)
    tokens = torch.tensor([[1, 5, 7, 2]])
    expected = model(tokens).logits
    for device_map, indices in (("cuda", {0}), ({"": 1}, {1}), ("auto", None)):
        loaded = GPT2LMHeadModel.from_pretrained(tmp_path, device_map=device_map).eval()
        devices = {p.device for p in loaded.parameters()}
        assert {d.type for d in devices} == {DEVICE_TYPE}, device_map
        if indices is not None:
            assert {d.index for d in devices} == indices, device_map
        first = next(loaded.parameters()).device
        assert torch.allclose(loaded(tokens.to(first)).logits.cpu(), expected, rtol=1e-5, atol=1e-6), device_map
