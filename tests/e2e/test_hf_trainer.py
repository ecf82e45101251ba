"""End to end: an HF ``Trainer`` script written for CUDA GPUs trains on 2 ranks on the selected device.

``hf_trainer_job.py`` builds a tiny GPT-2 from its config and trains it on synthetic tokens through ``Trainer`` seven
ways: without DeepSpeed (Accelerate's DDP), DeepSpeed ZeRO-2, ZeRO-3, ZeRO-2 with the optimizer offloaded to the
CPU and ZeRO-3 with parameters and optimizer offloaded, in fp32; DDP with fp16 and ZeRO-2 with bf16. Nothing in it
names a device: transformers and Accelerate choose from what ``torch.cuda`` answers, which the redirect answers for
the selected device. The environment holds
transformers, Accelerate, DeepSpeed and megatron-core at once (the job reports their versions).

What must be true on each platform (the host CPU, the emulated ``npu`` and ``tpu``), on every rank and in every run:

- ``TrainingArguments.device`` and ``Accelerator.device`` name the selected device at the rank's index (the CPU
  has one: Accelerate names it ``cpu:0``, as it does without devshim), not ``cuda:N``;
- Accelerate's backend and the process group's are the device's (``gloo``, ``hccl``, ``sccl``), not ``nccl``;
- Accelerate's distributed type is its own for the device where it has one (``MULTI_NPU``; ``MULTI_CPU`` on the host,
  whose DDP passes no ``device_ids``: with them DDP refuses a CPU module, and this run failed so before), its CUDA
  type where it has none (``MULTI_GPU`` on ``tpu``, served by the redirect), ``DEEPSPEED`` with DeepSpeed;
- parameters and optimizer states are on the device, or on the CPU where the configuration offloads them; fp16 runs
  Accelerate's autocast with a grad scaler, bf16 keeps DeepSpeed's bf16 weights;
- ``accelerate launch --multi_gpu`` starts the same job as torchrun does;
- each run's per-step losses equal those of the same ``Trainer`` without devshim and without DeepSpeed
  (``TrainingArguments(use_cpu=True)``, fp32, 2 ranks on gloo: the peer) within ``LOSS_RTOL`` (fp32; seen: equal to
  the last bit or 1 ulp apart) or ``LOSS_RTOL_HALF`` (fp16, bf16).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from devshim_core.testing.launch import free_port

from .launch import TIMEOUT_S, Job, job_env, run_job, venv_bin
from .platforms import ALL, SOPHGO, Platform, build_emulator

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")
pytest.importorskip("accelerate", reason="HF Trainer needs accelerate (requirements-dev.txt)")
pytest.importorskip("transformers", reason="HF Trainer needs transformers (requirements-dev.txt)")

JOB = Path(__file__).with_name("hf_trainer_job.py")
FIRST_LINE = Path(__file__).with_name("first_line.py")
RUNS = ("ddp", "ddp_fp16", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero2_bf16")
LOSS_RTOL = 1e-5
LOSS_RTOL_HALF = 1e-3  # fp16 autocast or bf16 weights against the fp32 peer (seen: 3e-5 and 1.1e-4)
DISTRIBUTED_TYPE = {"cpu": "MULTI_CPU", "npu": "MULTI_NPU", "tpu": "MULTI_GPU"}


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same Trainer without devshim: DDP on the CPU (use_cpu=True), the path transformers has there."""
    job = run_job("torchrun", ["--runs", "ddp", "--use-cpu"], tmp_path_factory.mktemp("peer"),
                  script=JOB, report=True)
    report = job.report(tolerate_upstream_exit_abort=True)
    assert report["devshim"] is False, job.tail()
    return report["ddp"]


@pytest.fixture(params=ALL, ids=[p.id for p in ALL])
def platform(request: pytest.FixtureRequest) -> Platform:
    if request.param.emulated:
        build_emulator()
    return request.param


def trainer_job(platform: Platform, workdir: Path) -> tuple[Job, dict[str, Any]]:
    job = run_job("torchrun", [str(JOB), "--runs", ",".join(RUNS)], workdir, env=platform.job_env(),
                  script=FIRST_LINE)
    return job, job.report()


def test_trainer_picks_the_selected_device_and_its_backend_and_matches_the_peer(tmp_path: Path, platform: Platform,
                                                                               peer: dict[str, Any]) -> None:
    job, report = trainer_job(platform, tmp_path)
    context = f"\nreport: {report}\n{job.tail(30)}"
    assert report["devshim"] is True, context
    assert all(report["installed"][d] for d in ("transformers", "accelerate", "deepspeed", "megatron-core")), context
    assert f"FIRST_LINE plugin={platform.plugin} device_type={platform.device_type}" in job.stdout, context

    for name in RUNS:
        run = report[name]
        for rank in run["ranks"]:
            where = f"run {name}, local rank {rank['local_rank']}{context}"
            own = platform.device_of_rank(rank["local_rank"])
            named = "cpu:0" if platform.device_type == "cpu" else own  # Accelerate's name for the host CPU
            assert rank["training_arguments_device"] == named, where
            assert rank["accelerator_device"] == named, where
            assert rank["accelerate_backend"] == platform.backend, where
            assert rank["process_group_backend"] == platform.backend, where
            expected_type = DISTRIBUTED_TYPE[platform.device_type] if name.startswith("ddp") else "DEEPSPEED"
            assert rank["distributed_type"] == expected_type, where
            assert rank["parameters"] == (["cpu"] if name == "zero3_offload" else [own]), where
            assert rank["optimizer_states"] == (["cpu"] if name.endswith("offload") else [own]), where
            # fp16 without DeepSpeed: Accelerate's autocast with a grad scaler, on the device (Accelerate itself
            # sets up fp16 only for devices it lists; tpu is not one, and on a device named cpu it ignores fp16)
            assert (rank["native_amp"], rank["grad_scaler"]) == ((True, "GradScaler") if name == "ddp_fp16"
                                                                 else (False, None)), where
            assert rank["parameter_dtypes"] == (["bfloat16"] if name == "zero2_bf16" else ["float32"]), where

        losses, reference = run["losses"], peer["losses"]
        rtol = LOSS_RTOL_HALF if name in ("ddp_fp16", "zero2_bf16") else LOSS_RTOL
        assert len(losses) == len(reference) == 6, f"run {name}: {losses}{context}"
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        assert worst <= rtol, (f"{platform.id} run {name}: losses differ from the peer's by {worst:.2e} "
                               f"(> {rtol:.0e}):\n  {losses}\n  peer: {reference}{context}")


def test_accelerate_launch_starts_the_same_job_on_the_device(tmp_path: Path, platform: Platform,
                                                            peer: dict[str, Any]) -> None:
    """``accelerate launch --multi_gpu --num_processes 2``, as a GPU user starts it: the launcher has no devshim (it
    only starts torch's elastic agent), each rank has, and the run is the one above."""
    report_path = tmp_path / "report.json"
    command = [str(venv_bin("accelerate")), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
               str(FIRST_LINE), str(JOB), "--runs", "ddp", "--report", str(report_path)]
    result = subprocess.run(command, cwd=tmp_path, env=job_env(tmp_path, platform.job_env()), capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    run = json.loads(report_path.read_text())["ddp"]
    for rank in run["ranks"]:
        assert rank["distributed_type"] == DISTRIBUTED_TYPE[platform.device_type], run
        assert rank["accelerate_backend"] == rank["process_group_backend"] == platform.backend, run
        assert rank["parameters"] == [platform.device_of_rank(rank["local_rank"])], run
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], peer["losses"], strict=True))
    assert worst <= LOSS_RTOL, (run["losses"], peer["losses"])


def test_without_the_integration_accelerate_names_cuda_on_a_device_it_has_no_path_for(tmp_path: Path) -> None:
    """The negative control, on the emulated ``tpu``: with ``DEVSHIM_DISABLE=huggingface`` the job still trains on
    the device over its backend (the redirect serves what Accelerate set up for CUDA), but Accelerate and
    ``TrainingArguments`` say ``cuda:N`` and ``nccl``: what the spec above rules out."""
    build_emulator()
    job = run_job("torchrun", [str(JOB), "--runs", "zero2"], tmp_path,
                  env=SOPHGO.job_env({"DEVSHIM_DISABLE": "huggingface"}), script=FIRST_LINE)
    for rank in job.report()["zero2"]["ranks"]:
        assert rank["training_arguments_device"] == f"cuda:{rank['local_rank']}", job.tail()
        assert rank["accelerate_backend"] == "nccl", job.tail()
        assert rank["parameters"] == [SOPHGO.device_of_rank(rank["local_rank"])], job.tail()
        assert rank["process_group_backend"] == SOPHGO.backend, job.tail()


def test_the_job_names_no_device_of_its_own() -> None:
    """What makes the spec above mean something: the job leaves every device decision to transformers and
    Accelerate (no 'cuda', 'npu', 'tpu' or .to() of its own)."""
    body = JOB.read_text().split('"""', 2)[2]  # after the docstring
    assert re.findall(r"\b(?:cuda|npu|tpu)\b|\.to\(|\bdevice\s*=|set_device", body) == []
