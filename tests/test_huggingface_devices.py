"""Spec: HF Accelerate and transformers, in one process on the host CPU, name the device the parameters are on.

The CUDA redirect answers ``torch.cuda.is_available()`` True for the selected device, to every caller (a script gates
``model.cuda()`` on it). transformers and Accelerate have no path of their own for the host CPU under that answer, so
they take CUDA: before the ``huggingface`` integration, ``TrainingArguments.device`` said ``cuda:0`` while every
parameter was on the CPU. Now they name the CPU, and what they set up for CUDA still works: fp16 autocast and its
grad scaler. The 2-rank ``Trainer`` runs, with DeepSpeed, on the CPU and the emulated devices, are
``tests/e2e/test_hf_trainer.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from devshim_core import session

accelerate = pytest.importorskip("accelerate", reason="requirements-dev.txt installs accelerate")
transformers = pytest.importorskip("transformers", reason="requirements-dev.txt installs transformers")
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

CPU = torch.device("cpu")
ENV = {"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_PATCH_DEEPSPEED": "0", "DEVSHIM_PATCH_MEGATRON": "0"}


def devshims() -> dict[str, bool]:
    """Whether Accelerate's backend choice and transformers' device choice are devshim's wrappers (they carry the
    original they wrap)."""
    return {"accelerate": hasattr(PartialState.__dict__["_prepare_backend"], "__devshim_original__"),
            "transformers": hasattr(TrainingArguments.__dict__["_setup_devices"].func, "__devshim_original__")}


@contextlib.contextmanager
def activated(**environ: str) -> Iterator[session.Session]:
    """devshim on the host CPU, in a single process (no LOCAL_RANK); Accelerate's shared state reset around it."""
    had_session = session.current() is not None
    session.deactivate()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_TORCH_DEVICE", "ACCELERATE_USE_CPU"):
                mp.delenv(name, raising=False)
            active = session.activate({**ENV, **environ})
            yield active
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        session.deactivate()
        if had_session:
            session.activate()


def test_training_arguments_name_the_cpu_where_transformers_took_cuda(tmp_path):
    with activated() as active:
        assert torch.cuda.is_available()  # the redirect's answer, which transformers reads
        assert TrainingArguments(output_dir=str(tmp_path), report_to=[]).device == CPU
        assert active.integrations["huggingface-transformers"].startswith("applied")


def test_without_the_integration_transformers_names_cuda_while_the_parameters_are_on_the_cpu(tmp_path):
    """The negative control: what the set above changes."""
    with activated(DEVSHIM_DISABLE="huggingface"):
        assert TrainingArguments(output_dir=str(tmp_path), report_to=[]).device == torch.device("cuda", 0)
        assert torch.zeros(1, device="cuda").device == CPU


def test_accelerate_names_the_cpu_and_still_sets_up_fp16_for_it():
    """Accelerate ignores fp16 on a device named cpu; under devshim a CUDA script asked for fp16 and got it (autocast
    on the device, a grad scaler), and still does, now that the device is named for what it is."""
    with activated() as active:
        assert PartialState().device == CPU
        accelerator = Accelerator(mixed_precision="fp16")
        assert accelerator.device == CPU
        assert isinstance(accelerator.scaler, torch.amp.GradScaler)
        x = torch.randn(4, 4, device=accelerator.device)
        with accelerator.autocast():
            assert (x @ x).dtype == torch.float16
        assert active.integrations["huggingface-accelerate"].startswith("applied")


def test_a_cpu_the_user_asked_for_keeps_accelerates_own_set_up():
    """``cpu=True`` is Accelerate's own CPU path, not CUDA renamed: fp16 is ignored there, as without devshim."""
    with activated():
        accelerator = Accelerator(cpu=True, mixed_precision="fp16")
        assert accelerator.device == CPU
        assert accelerator.scaler is None and accelerator.native_amp is False


def test_from_pretrained_device_map_auto_and_cuda_put_the_model_on_the_cpu(tmp_path):
    """``device_map='auto'`` failed here ("Cannot access accelerator device when none is available": Accelerate
    budgeted the redirect's device 0, the host, and transformers made ``torch.device(0)`` of it); without devshim it
    maps everything to the CPU, and so it does now. ``device_map='cuda'`` is the redirect's. (``{'': 0}`` fails on a
    host without an accelerator with or without devshim: ``torch.device(0)`` names the current accelerator.)"""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)).eval()
    model.save_pretrained(tmp_path)
    tokens = torch.tensor([[1, 5, 7, 2]])
    expected = model(tokens).logits
    with activated() as active:
        for device_map in ("auto", "cuda"):
            loaded = GPT2LMHeadModel.from_pretrained(tmp_path, device_map=device_map).eval()
            assert {p.device for p in loaded.parameters()} == {CPU}, device_map
            assert torch.equal(loaded(tokens).logits, expected), device_map
        assert all(not isinstance(key, int) for key in accelerate.utils.get_max_memory())
        assert active.integrations["huggingface-accelerate-memory"].startswith("applied")


def test_deactivation_gives_accelerate_and_transformers_their_own_code_back():
    with activated():
        assert devshims() == {"accelerate": True, "transformers": True}
        session.deactivate()
        assert devshims() == {"accelerate": False, "transformers": False}


def test_without_the_redirect_the_integration_stands_aside():
    """``torch.cuda`` then answers False, Accelerate never takes CUDA, and there is nothing to rename."""
    with activated(DEVSHIM_REDIRECT_CUDA="0") as active:
        assert active.integrations["huggingface"].startswith("skipped: needs the cuda-redirect integration")
        assert devshims() == {"accelerate": False, "transformers": False}
