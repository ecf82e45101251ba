"""End to end: unmodified DeepSpeed training on 2 ranks through devshim, on three platforms:

- ``cpu``: the host CPU through the ``cpu_reference`` plugin, over gloo;
- ``npu``: the emulated Ascend device through the ``ascend`` plugin (``DEVSHIM_EMULATE=ascend``), over hccl;
- ``tpu``: the emulated Sophgo device through the ``sophgo`` plugin (``DEVSHIM_EMULATE=sophgo``), over sccl.

Every test launches ``examples/train_gpt.py`` as a real multi-process job (``torchrun``, or the ``deepspeed``
launcher) and reads the JSON report rank 0 writes, which carries every rank's view of the accelerator,
plugin and optimizer op. Each job combines several features so that the module stays fast (~2 minutes on
2 cores):

=========================================  ===========  =====================================================
job                                        launcher     proves
=========================================  ===========  =====================================================
ZeRO-1 + bf16 + gradient accumulation      torchrun     ``import deepspeed`` before devshim still gets
                                                        devshim's op builders (FusedAdamOp)
ZeRO-2 + optimizer offload + grad. accum.  torchrun     ZeRO-Offload steps Adam with devshim's HostAdamOp;
  + activation checkpointing                            every block is recomputed in backward
ZeRO-3 + activation checkpointing, save    torchrun     client state round-trips; resumed losses are
  at step 5, resume (2 jobs; cpu and tpu)               bit-identical to the uninterrupted run; the recompute
                                                        re-gathers partitioned parameters
ZeRO-0 with DEVSHIM_AUTO=1                 deepspeed    the launcher itself sized the job (2 ranks) from
                                                        devshim's device count, with no --num_gpus
pipeline engine, 2 stages, ZeRO-1 (cpu,    torchrun     one stage per rank, trained through devshim
  tpu)
=========================================  ===========  =====================================================

Every job also proves that DeepSpeed ran through devshim's accelerator on every rank, that the loss fell,
and that nothing was JIT-compiled (each job gets a fresh TORCH_EXTENSIONS_DIR that must stay empty). On an
emulated device it also proves that parameters, gradients and (unless offloaded) optimizer states live on
the rank's own device index, that the vendor backend ran the collectives (``dist.get_backend()``), and that
the losses match the same job on the CPU within ``EMULATED_LOSS_RTOL`` (fp32) or ``EMULATED_LOSS_RTOL_HALF``
(bf16/fp16): the emulator runs the CPU kernels, except where an op's device decomposition differs (LayerNorm,
~1e-7 per call).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .launch import Job, assert_loss_fell, run_job
from .platforms import ALL, CPU, SOPHGO, Platform, build_emulator

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")

STEPS = 10
# Cross-entropy starts near ln(128) = 4.85 and these runs reach ~3.6-3.8 after 10 steps (a drop of 1.2-1.4
# nats); every run is seeded and deterministic, so requiring half a nat is far from noise yet proves learning.
LOSS_DROP = 0.5
EMULATED_LOSS_RTOL = 1e-4
EMULATED_LOSS_RTOL_HALF = 2e-2
_cpu_losses: dict[tuple[str, ...], list[float]] = {}


@pytest.fixture(params=ALL, ids=[p.id for p in ALL])
def platform(request: pytest.FixtureRequest) -> Platform:
    if request.param.emulated:
        build_emulator()
    return request.param


def train(platform: Platform, args: list[str], workdir: Path, env: dict[str, str] | None = None,
          launcher: str = "torchrun", launcher_args: tuple[str, ...] = ()) -> Job:
    job = run_job(launcher, args, workdir, env=platform.job_env(env), launcher_args=launcher_args)
    if platform.device_type == "cpu" and job.returncode == 0 and job.report_path.exists():
        _cpu_losses[tuple(args)] = job.report()["losses"]
    return job


def assert_matches_cpu(platform: Platform, args: list[str], losses: list[float], workdir: Path, job: Job) -> None:
    """An emulated job computes what the same job computes on the CPU, within the stated tolerance."""
    if not platform.emulated:
        return
    key = tuple(args)
    if key not in _cpu_losses:  # the CPU variant was deselected: run it for the reference
        train(CPU, args, workdir / "cpu-reference").report()
    rtol = EMULATED_LOSS_RTOL_HALF if ("--bf16" in args or "--fp16" in args) else EMULATED_LOSS_RTOL
    reference = _cpu_losses[key]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    assert worst <= rtol, (f"{platform.id} losses differ from the CPU's by {worst:.2e} (> {rtol:.0e}):\n"
                           f"  {platform.id}: {losses}\n  cpu: {reference}\n{job.tail()}")


def assert_trained_through_devshim(job: Job, report: dict[str, Any], *, optimizer_op: str,
                                   platform: Platform) -> None:
    """Both ranks ran DeepSpeed on devshim's accelerator/plugin and stepped with devshim's ``optimizer_op``; on a
    vendor device, each rank's parameters, gradients and optimizer states sit on its own device index and the
    vendor's backend ran the collectives."""
    context = f"\nreport: {report}\n{job.tail()}"
    assert report["rank_count"] == 2, context
    assert report["backend"] == platform.backend, context
    assert report["accelerator_module"] == "devshim_core.integrations.deepspeed.accelerator", context
    assert [r["rank"] for r in report["ranks"]] == [0, 1], context
    for rank in report["ranks"]:
        assert rank["accelerator"] == "DevshimAccelerator", context
        assert rank["plugin"] == platform.plugin, context
        assert rank["dist_backend"] == platform.backend, context  # torch's answer, not the accelerator's
        own = platform.device_of_rank(rank["local_rank"])
        assert rank["current_device"] == rank["local_rank"], context
        assert rank["device"] == own and rank["param_devices"] == [own], context
        assert rank["grad_devices"] == [own], context
        offloaded = optimizer_op == "HostAdamOp"
        assert rank["optimizer_state_devices"] == (["cpu"] if offloaded else [own]), context
        if offloaded:  # asked for pinned host memory: a vendor device pins it, the CPU has nothing to pin
            assert rank["offload_partitions_pinned"] == [platform.device_type != "cpu"], context
        if optimizer_op == "FusedAdamOp":  # DeepSpeed's FusedAdam on devshim's fused kernel
            assert rank["basic_optimizer"] == "FusedAdam", context
            assert rank["fused_op"] == "FusedAdamOp", context
        else:  # ZeRO-Offload: DeepSpeedCPUAdam on devshim's host kernel
            assert rank["basic_optimizer"] == "DeepSpeedCPUAdam", context
            assert rank["engine_optimizer_op"] == optimizer_op, context
    assert f"devshim: plugin {platform.plugin}" in job.stdout, context
    assert job.compiled_extensions() == [], f"a DeepSpeed op was JIT-compiled: {job.compiled_extensions()}{context}"


def assert_gradient_accumulation(job: Job, report: dict[str, Any], micro_batches: int) -> None:
    """The engine stepped the optimizer once per ``micro_batches`` forward/backward passes."""
    assert report["gradient_accumulation_steps"] == micro_batches, job.tail()
    assert report["optimizer_steps"] == STEPS, job.tail()
    assert report["micro_steps"] == STEPS * micro_batches, job.tail()


def test_zero1_bf16_gradient_accumulation_with_deepspeed_imported_before_devshim(tmp_path: Path,
                                                                                   platform: Platform) -> None:
    """A script that runs ``import deepspeed`` before ``import devshim_core.auto`` still trains on devshim.

    DeepSpeed has by then auto-detected its own CPU accelerator and bound op builders from it; devshim must
    rebind them so that FusedAdam loads devshim's FusedAdamOp (and nothing is compiled). The same job proves
    ZeRO-1 partitioning of bf16 parameters with 2 micro-batches accumulated per optimizer step.
    """
    args = ["--zero-stage", "1", "--bf16", "--grad-accum", "2", "--steps", str(STEPS)]
    job = train(platform, args, tmp_path, env={"DEVSHIM_EXAMPLE_IMPORT_DEEPSPEED_FIRST": "1"})
    report = job.report()

    assert_trained_through_devshim(job, report, optimizer_op="FusedAdamOp", platform=platform)
    assert_matches_cpu(platform, args, report["losses"], tmp_path, job)
    for rank in report["ranks"]:
        assert rank["deepspeed_imported_before_devshim"] is True, job.tail()
        assert rank["deepspeed_integration"].startswith("applied (deepspeed was imported first"), rank
        assert rank["param_dtype"] == "torch.bfloat16", rank
    assert report["zero_stage"] == 1
    assert report["optimizer"] == "DeepSpeedZeroOptimizer"
    assert report["bf16"] is True
    assert_gradient_accumulation(job, report, micro_batches=2)
    assert_loss_fell(report["losses"], STEPS, LOSS_DROP, job)


# DeepSpeed's checkpoint backward restores the RNG state with get_accelerator().default_generator(current_device());
# on rank 1 (current device 1) that indexes the cpu_reference device module's one-element ``default_generators``.
# ZeRO-3 (the resume test) hides it: its Init calls set_device(torch.device("cpu")), which resets every
# rank's current device to 0.
def test_zero2_optimizer_offload_steps_adam_with_devshim_host_kernel(tmp_path: Path, platform: Platform) -> None:
    """ZeRO-2 with the optimizer offloaded to the host (ZeRO-Offload) runs DeepSpeedCPUAdam on HostAdamOp.

    The devshim line comes first (the default import order), so devshim's builders are armed before DeepSpeed
    binds them; DeepSpeedCPUAdam's ``ds_opt_adam`` is devshim's HostAdamOp on both ranks, with 2 micro-batches
    accumulated per step. The blocks are activation-checkpointed: each is run twice per micro-batch (forward,
    then the recompute in backward, whose RNG state comes back through devshim's accelerator).
    """
    args = ["--zero-stage", "2", "--offload", "--grad-accum", "2", "--activation-checkpointing", "--steps",
            str(STEPS)]
    job = train(platform, args, tmp_path)
    report = job.report()

    assert_trained_through_devshim(job, report, optimizer_op="HostAdamOp", platform=platform)
    assert_matches_cpu(platform, args, report["losses"], tmp_path, job)
    for rank in report["ranks"]:
        assert rank["deepspeed_imported_before_devshim"] is False, rank
        assert rank["deepspeed_integration"].startswith("applied when deepspeed is imported"), rank  # armed, fired
        assert rank["blocks"] == 2 and rank["forwards_per_block_per_micro_batch"] == 2.0, rank
    assert report["zero_stage"] == 2
    assert report["optimizer"] == "DeepSpeedZeroOptimizer"
    assert_gradient_accumulation(job, report, micro_batches=2)
    assert_loss_fell(report["losses"], STEPS, LOSS_DROP, job)


# not on npu: the reference job's resumes (ZeRO-1 and ZeRO-2) and its npu -> cpu checkpoint cover that device
@pytest.mark.parametrize("platform", [CPU, SOPHGO], ids=["cpu", "tpu"], indirect=True)
def test_zero3_checkpoint_resume_restores_client_state_and_reproduces_losses_exactly(tmp_path: Path,
                                                                                      platform: Platform) -> None:
    """save_checkpoint at step 5 then load_checkpoint in a new job continues exactly where training left off.

    Job 1 trains 10 steps uninterrupted and saves a ZeRO-3 checkpoint after step 5 with client state
    {step, losses so far}. Job 2 (new processes) loads it and trains steps 6-10. Proven: the client state comes
    back unchanged, the engine's step counter is restored, and the resumed losses EQUAL those of the
    uninterrupted run, bit for bit. Exact equality is the right bar: the run is fp32, the data of step k is
    generated from k alone, the model has no dropout, a gloo sum over 2 ranks is order-independent, and the
    checkpoint holds the fp32 master parameters and Adam moments verbatim; any difference would mean state was
    lost or altered in the round trip.

    Both jobs checkpoint activations: each block runs twice per micro-batch (forward, then the recompute in
    backward, which re-gathers ZeRO-3's partitioned parameters), and the recompute changes no number.
    """
    ckpt = tmp_path / "checkpoints"
    first = train(platform, ["--zero-stage", "3", "--activation-checkpointing", "--steps", str(STEPS), "--save-dir",
                             str(ckpt), "--save-at", "5"], tmp_path / "uninterrupted")
    uninterrupted = first.report()
    assert_trained_through_devshim(first, uninterrupted, optimizer_op="FusedAdamOp", platform=platform)
    for rank in uninterrupted["ranks"]:
        assert rank["blocks"] == 2 and rank["forwards_per_block_per_micro_batch"] == 2.0, rank
    assert uninterrupted["zero_stage"] == 3
    assert uninterrupted["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert_loss_fell(uninterrupted["losses"], STEPS, LOSS_DROP, first)
    assert (ckpt / "latest").read_text().strip() == "global_step5", sorted(p.name for p in ckpt.iterdir())

    second = train(platform, ["--zero-stage", "3", "--activation-checkpointing", "--steps", str(STEPS), "--load-dir",
                              str(ckpt)], tmp_path / "resumed")
    resumed = second.report()
    assert_trained_through_devshim(second, resumed, optimizer_op="FusedAdamOp", platform=platform)
    assert [r["start_step"] for r in resumed["ranks"]] == [5, 5], second.tail()
    assert resumed["client_state"] == {"step": 5, "losses": uninterrupted["losses"][:5]}, second.tail()
    assert resumed["optimizer_steps"] == STEPS, second.tail()
    assert resumed["losses"] == uninterrupted["losses"][5:], (
        f"resumed losses differ from the uninterrupted run's:\n  uninterrupted steps 6-10: "
        f"{uninterrupted['losses'][5:]}\n  resumed:                   {resumed['losses']}\n{second.tail()}")


def test_deepspeed_launcher_sizes_the_job_from_devshim_device_count(tmp_path: Path, platform: Platform) -> None:
    """The ``deepspeed`` launcher, given no --num_gpus, starts one rank per devshim device (ZeRO-0, fp16).

    With DEVSHIM_AUTO=1 devshim activates at interpreter start-up in the launcher process itself, so the
    launcher's ``get_accelerator().device_count()`` is devshim's (DEVSHIM_CPU_DEVICE_COUNT=2): it starts 2
    ranks and hands them devshim's visible-devices variable. The ranks, which never ran devshim's import
    line before DeepSpeed's, train plain data-parallel (ZeRO-0) in fp16 with dynamic loss scaling, DeepSpeed's
    FP16_Optimizer stepping devshim's FusedAdamOp.
    """
    args = ["--zero-stage", "0", "--fp16", "--steps", str(STEPS)]
    job = train(platform, args, tmp_path, env={"DEVSHIM_AUTO": "1", **platform.two_devices_env}, launcher="deepspeed")
    assert "--num_gpus" not in job.command and "--num_nodes" not in job.command
    report = job.report()

    assert "WORLD INFO DICT: {'localhost': [0, 1]}" in job.output, job.tail()
    assert f"Setting {platform.visible_devices_env}=0,1" in job.output, job.tail()
    assert_trained_through_devshim(job, report, optimizer_op="FusedAdamOp", platform=platform)
    assert_matches_cpu(platform, args, report["losses"], tmp_path, job)
    for rank in report["ranks"]:
        assert rank["device_count"] == 2, rank
        assert rank["visible_devices"] == {platform.visible_devices_env: "0,1"}, rank
    assert report["zero_stage"] == 0
    assert report["optimizer"] == "FP16_Optimizer"  # no ZeRO wrapper at stage 0, fp16's master-weight one
    assert all(rank["param_dtype"] == "torch.float16" for rank in report["ranks"])
    assert report["data_parallel_size"] == 2
    assert_loss_fell(report["losses"], STEPS, LOSS_DROP, job)


# not on npu: the reference job trains its pipeline there against the whole model
@pytest.mark.parametrize("platform", [CPU, SOPHGO], ids=["cpu", "tpu"], indirect=True)
def test_pipeline_engine_trains_two_stages_one_per_rank(tmp_path: Path, platform: Platform) -> None:
    """DeepSpeed's PipelineEngine splits the GPT into 2 stages, one per rank, and trains it through devshim.

    Stage 0 holds the embedding and the first block, stage 1 the second block and the head (uniform
    partition); each step runs 2 micro-batches through the pipeline schedule, with activations and gradients
    sent between the ranks over gloo, and each stage's ZeRO-1 optimizer steps with devshim's FusedAdamOp.
    """
    args = ["--pipeline-stages", "2", "--zero-stage", "1", "--grad-accum", "2", "--steps", str(STEPS)]
    job = train(platform, args, tmp_path)
    report = job.report()

    assert_trained_through_devshim(job, report, optimizer_op="FusedAdamOp", platform=platform)
    assert_matches_cpu(platform, args, report["losses"], tmp_path, job)
    assert report["engine"] == "PipelineEngine"
    assert report["pipeline_stages"] == 2
    assert report["data_parallel_size"] == 1
    assert report["gradient_accumulation_steps"] == 2
    assert report["optimizer_steps"] == STEPS
    assert [(r["pipeline_stage"], r["blocks"]) for r in report["ranks"]] == [(0, 1), (1, 1)], report["ranks"]
    assert_loss_fell(report["losses"], STEPS, LOSS_DROP, job)
