"""Spec: a checkpoint from a GPU cluster, as it arrives, loads under devshim -- here on the CPU (``cpu_reference``).

The fault injected is the checkpoint itself: every storage's location string says ``cuda:N``, as torch writes it for
tensors that lived on GPU N (``cuda_checkpoint_job.saved_on_gpu`` tags host storages that way; each spec reads the
file's ``data.pkl`` to show that it does). Plain torch on a machine without CUDA refuses such a file ("Attempting to
deserialize object on a CUDA device but torch.cuda.is_available() is False"), and before this part of issue 28
devshim's redirect failed even ``map_location='cuda'`` with ``TypeError: isinstance() arg 2 must be a type``.

What the user sees now: ``torch.load`` with no ``map_location``, or with ``'cuda'``, ``'cuda:N'``,
``torch.device('cuda', N)``, a dict or a function mapping to cuda, puts every storage on the selected device with the
values the GPU saved (the CPU has one device whatever N); ``torch.save`` on the CPU writes ``cpu`` locations, which
a plain torch process loads with or without ``map_location``. The same holds through transformers'
``from_pretrained``, DeepSpeed's ``load_checkpoint`` and megatron-core's ``dist_checkpointing.load``. The CUDA names
a checkpointing script touches on the way are served or refused by name: ``torch.cuda.device`` stays a class,
``torch.Generator(device='cuda')`` and ``torch.UntypedStorage(n, device='cuda')`` are made on the device, and
``torch.cuda.utilization()`` answers from the vendor's module or says it cannot.

The emulated ``npu``/``tpu``, where indices and the saved tags differ, are specified in
``tests/emulated/test_cuda_checkpoints_emulated.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_checkpoint_job import run, saved_on_gpu, storage_locations

from devshim_core import session
from devshim_core.errors import DevshimError

ENV = {"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_PATCH_DEEPSPEED": "0", "DEVSHIM_PATCH_MEGATRON": "0"}
CPU = torch.device("cpu")
A, B = torch.arange(4.0), torch.arange(4.0) * 10  # saved as if from GPU 0 and GPU 1
NO_CUDA = "Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False"


@contextlib.contextmanager
def activated(**environ: str) -> Iterator[session.Session]:
    """devshim activated on two CPU device slots; afterwards the session this process had before is activated again."""
    had_session = session.current() is not None
    session.deactivate()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DEVSHIM_CPU_DEVICE_COUNT", "2")
            active = session.activate({**ENV, **environ})
        yield active
    finally:
        session.deactivate()
        if had_session:
            session.activate()


@pytest.fixture
def cuda() -> Iterator[session.Session]:
    with activated() as active:
        yield active
        torch.cuda.set_device(0)


def on_gpus(storage: Any) -> int:
    """A's storage was on GPU 0, B's on GPU 1."""
    return 1 if storage.data_ptr() == B.untyped_storage().data_ptr() else 0


@pytest.fixture(params=["zip", "legacy"])
def gpu_checkpoint(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """{'a': A, 'b': B} as torch.save writes it on a two-GPU machine, in the zip format (torch >= 1.6's default) or
    the legacy one (``_use_new_zipfile_serialization=False``)."""
    path = tmp_path / f"from_gpus_{request.param}.pt"
    with saved_on_gpu(on_gpus):
        torch.save({"a": A, "b": B}, path, _use_new_zipfile_serialization=request.param == "zip")
    return path


# -- the checkpoint, and what plain torch does with it --------------------------------------------------------------

def test_the_fixture_writes_what_two_gpus_write(tmp_path):
    path = tmp_path / "from_gpus.pt"
    with saved_on_gpu(on_gpus):
        torch.save({"a": A, "b": B}, path)
    assert storage_locations(path) == ["cuda:0", "cuda:1"]
    assert torch.serialization.location_tag(A.untyped_storage()) == "cpu"  # the tagging ended with the block


def test_plain_torch_without_cuda_refuses_it_unless_mapped_to_the_cpu(tmp_path):
    path = tmp_path / "from_gpus.pt"
    with saved_on_gpu(on_gpus):
        torch.save({"a": A, "b": B}, path)
    refused = run(tmp_path, "plain-load", str(path))
    assert refused["plain"] and refused["loaded"] is None
    assert refused["error"].startswith(f"RuntimeError: {NO_CUDA}"), refused["error"]
    mapped = run(tmp_path, "plain-load", str(path), "cpu")
    assert mapped["loaded"] == {"a": {"device": "cpu", "values": A.tolist()},
                                "b": {"device": "cpu", "values": B.tolist()}}


# -- torch.load under devshim ----------------------------------------------------------------------------------------

MAP_LOCATIONS: dict[str, Any] = {
    "none": None,
    "'cuda'": "cuda",
    "'cuda:0'": "cuda:0",
    "'cuda:1'": "cuda:1",
    "torch.device('cuda')": torch.device("cuda"),
    "torch.device('cuda',1)": torch.device("cuda", 1),
    "dict-swapping-gpus": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"},
    "storage.cuda()": lambda storage, location: storage.cuda(),
    "storage.cuda(1)": lambda storage, location: storage.cuda(1),
    "storage.to('cuda:1')": lambda storage, location: storage.to(device="cuda:1"),
    "'cpu'": "cpu",
}


@pytest.mark.parametrize("map_location", list(MAP_LOCATIONS.values()), ids=list(MAP_LOCATIONS))
def test_torch_load_puts_a_gpu_checkpoint_on_the_device_with_its_values(cuda, gpu_checkpoint, map_location):
    loaded = torch.load(gpu_checkpoint, map_location=map_location)
    assert {k: (v.device, v.tolist()) for k, v in loaded.items()} == {"a": (CPU, A.tolist()), "b": (CPU, B.tolist())}


@pytest.mark.parametrize("weights_only", [True, False])
def test_mmap_and_both_unpicklers_load_it_too(cuda, tmp_path, weights_only):
    path = tmp_path / "from_gpus.pt"
    with saved_on_gpu(on_gpus):
        torch.save({"a": A, "b": B}, path)
    loaded = torch.load(path, mmap=True, weights_only=weights_only)  # transformers loads .bin files with mmap
    assert torch.equal(loaded["a"], A) and torch.equal(loaded["b"], B) and loaded["b"].device == CPU


def test_any_gpu_index_loads_on_the_cpu_which_has_one_device(cuda, tmp_path):
    path = tmp_path / "from_gpu_7.pt"
    with saved_on_gpu(lambda storage: 7):  # rank 7 of an 8-GPU node: the CPU device is every index
        torch.save({"a": A}, path)
    assert storage_locations(path) == ["cuda:7"]
    assert torch.equal(torch.load(path)["a"], A)


def test_torch_save_on_the_cpu_writes_cpu_locations_that_plain_torch_loads(cuda, tmp_path):
    path = tmp_path / "saved_under_devshim.pt"
    torch.save({"a": A.cuda(), "b": torch.tensor(B.tolist(), device="cuda:1")}, path)
    assert storage_locations(path) == ["cpu", "cpu"]  # the CPU's tensors are the host's: cpu loads anywhere
    report = run(tmp_path, "plain-load", str(path))
    assert report["plain"] and report["loaded"] == {"a": {"device": "cpu", "values": A.tolist()},
                                                   "b": {"device": "cpu", "values": B.tolist()}}


def test_deactivation_takes_devshims_locations_out_of_torchs_registry(tmp_path):
    had_session = session.current() is not None
    session.deactivate()
    try:
        before = list(torch.serialization._package_registry)
        with activated():
            assert len(torch.serialization._package_registry) == len(before) + 2
        assert torch.serialization._package_registry == before
    finally:
        if had_session and session.current() is None:
            session.activate()


# -- the CUDA names a checkpointing script touches ---------------------------------------------------------------------

def test_torch_cuda_device_is_a_class_and_torchs_index_helper_reads_it(cuda):
    assert isinstance(torch.cuda.device, type)
    context = torch.cuda.device("cuda:1")
    assert isinstance(context, torch.cuda.device) and not isinstance("cuda:1", torch.cuda.device)
    assert torch.cuda._utils._get_device_index(context) == 1  # the isinstance that raised TypeError before
    assert torch.cuda._utils._get_device_index("cuda:1") == 1
    with context:
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 0


def test_generator_on_cuda_is_the_devices_and_every_generator_is_a_torch_generator(cuda):
    for made in (torch.Generator(device="cuda"), torch.Generator("cuda:1"), torch.Generator(torch.device("cuda"))):
        assert made.device == CPU and type(made) is torch._C.Generator
        assert isinstance(made, torch.Generator)
    assert isinstance(torch.default_generator, torch.Generator) and isinstance(torch.Generator, type)
    assert torch.Generator().device == CPU
    g = torch.Generator(device="cuda")
    first = torch.randn(4, device="cuda", generator=g.manual_seed(7))
    assert torch.equal(torch.randn(4, device="cuda", generator=g.manual_seed(7)), first)


def test_generator_is_torchs_own_again_after_deactivation():
    with activated():
        assert torch.Generator is not torch._C.Generator
        session.deactivate()  # (the suite's own session, if any, comes back after the block)
        assert torch.Generator is torch._C.Generator


def test_untyped_storage_on_cuda_is_allocated_on_the_device(cuda):
    storage = torch.UntypedStorage(16, device="cuda")
    assert storage.device == CPU and storage.nbytes() == 16
    assert torch.UntypedStorage(8, device="cuda:1").device == CPU
    assert torch.UntypedStorage(8).cuda().device == CPU
    assert torch.UntypedStorage(8).to(device=torch.device("cuda", 1)).device == CPU


def test_utilization_is_refused_naming_the_call_where_the_device_reports_none(cuda):
    with pytest.raises(DevshimError) as refused:
        torch.cuda.utilization()
    message = str(refused.value)
    assert message.startswith("torch.cuda.utilization() has no answer on cpu (devshim plugin cpu_reference)"), message
    assert "Remove the call" in message


def test_utilization_is_the_vendor_modules_where_it_has_one(monkeypatch):
    from devshim_cpu_reference.device_module import CpuDeviceModule

    # a stand-in for torch_npu's torch.npu.utilization(device): the cpu_reference module has none
    monkeypatch.setattr(CpuDeviceModule, "utilization", lambda self, index: 40 + index, raising=False)
    with activated():
        assert (torch.cuda.utilization(), torch.cuda.utilization("cuda:1"), torch.cuda.utilization(1)) == (40, 41, 41)


# -- frameworks' loaders ---------------------------------------------------------------------------------------------

def test_transformers_loads_a_gpt2_saved_on_a_gpu_and_moves_it_to_cuda(cuda, tmp_path):
    """transformers writes safetensors (no locations at all) and reads .bin files with map_location='cpu': a .bin
    from a GPU loads even without devshim. The spec: both load here with the GPU's values, and `.to('cuda')`, as a
    CUDA user then writes, lands on the device. (`device_map=...`: tests/test_huggingface_devices.py.)"""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)).eval()
    tokens = torch.tensor([[1, 5, 7, 2]])
    expected = model(tokens).logits
    bin_dir, safetensors_dir = tmp_path / "bin", tmp_path / "safetensors"
    model.config.save_pretrained(bin_dir)
    with saved_on_gpu():  # what transformers 4's save_pretrained(safe_serialization=False) wrote on GPU 0
        torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    assert set(storage_locations(bin_dir / "pytorch_model.bin")) == {"cuda:0"}
    model.save_pretrained(safetensors_dir)
    for directory in (bin_dir, safetensors_dir):
        loaded = GPT2LMHeadModel.from_pretrained(directory).to("cuda").eval()
        assert {p.device for p in loaded.parameters()} == {CPU}
        assert torch.equal(loaded(tokens.cuda()).logits, expected), directory.name


def test_deepspeed_load_checkpoint_resumes_from_a_checkpoint_written_on_a_gpu(tmp_path):
    # DeepSpeed reads its files with map_location='cpu' (or the storage as read): the locations do not decide here;
    # the spec is that a GPU's checkpoint resumes training on the device, weights and optimizer state alike
    report = run(tmp_path, "deepspeed", str(tmp_path / "checkpoints"), DEVSHIM_PLUGIN="cpu_reference")
    files = report["locations"]
    assert set(files) == {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert all(locations and set(locations) == {"cuda:0"} for locations in files.values()), files
    assert report["differed_before_loading"] and report["equal_after_loading"]
    assert report["param_devices"] == ["cpu"]
    assert report["resumed_next_loss"] == report["next_loss"]  # weights and Adam's moments both came back


def test_megatron_dist_checkpointing_loads_objects_and_tensors_written_on_a_gpu(tmp_path):
    report = run(tmp_path, "megatron", str(tmp_path / "checkpoint"), DEVSHIM_PLUGIN="cpu_reference")
    # torch_dist keeps each tensor and each object as torch.save bytes; objects are read with no map_location
    assert report["object_locations"] == {"weight": ["cuda:0"], "extra/shard_0_1": ["cuda:0", "cuda:0"]}
    assert report["weight"] == {"device": "cpu", "equal": True}
    assert report["extra"] == {"step": {"device": "cpu", "equal": True}, "ema": {"device": "cpu", "equal": True}}

