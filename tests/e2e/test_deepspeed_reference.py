"""Spec: DeepSpeed through devshim computes what plain PyTorch computes, on 2 ranks (``deepspeed_reference_job.py``).

A falling loss would not catch a mis-wired AdamW, wrong accumulation scaling or a clipping regression; these
compare every step's loss and the final weights with ``DistributedDataParallel`` + ``torch.optim.AdamW`` +
``clip_grad_norm_`` from the same weights and data. Tolerances (fp32): losses within a relative 1e-6 and weights
within 1e-6 absolute. Measured on cpu: 1.2e-7 and 1e-7 (reduction order is all that differs). Resumes are
exact (``==``).
"""

from __future__ import annotations

import math
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from devshim_core.patching import version_in_range

from .curriculum_sampling import MICRO_BATCH, SCHEDULE, SEQLEN, STEPS
from .launch import run_job
from .platforms import ASCEND, CPU, Platform, build_emulator

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")

JOB = Path(__file__).resolve().parent / "deepspeed_reference_job.py"
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-6
# DeepSpeed before 0.19 divides the last stage's loss, not its gradients, by the accumulation steps: other rounding,
# which six Adam steps grow to 4.3e-6 on 0.16.0 (1e-7 on 0.19.8)
PIPELINE_WEIGHT_ATOL = WEIGHT_ATOL if version_in_range(metadata.version("deepspeed"), ">=0.19") else 1e-5
_jobs: dict[str, tuple[dict[str, Any], Path]] = {}


def run_reference_job(platform: Platform, workdir: Path, *args: str, ranks: int = 2) -> dict[str, Any]:
    if platform.emulated:
        build_emulator()
    job = run_job("torchrun", list(args), workdir, script=JOB, ranks=ranks,
                  env=platform.job_env({**platform.two_devices_env, "DEVSHIM_PLUGIN": platform.plugin}))
    result = job.report()
    assert result["world"] == ranks and result["device"] == platform.device_of_rank(0), result["device"]
    assert job.compiled_extensions() == [], job.compiled_extensions()
    return result


def reference_job(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The job on ``platform``, run once per session: its report and its working directory."""
    if platform.id not in _jobs:
        workdir = tmp_path_factory.mktemp(f"reference-{platform.id}")
        _jobs[platform.id] = (run_reference_job(platform, workdir), workdir)
    return _jobs[platform.id]


@pytest.fixture(scope="module", params=(CPU, ASCEND), ids=("cpu", "npu"))
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job per platform, shared by the specs below (each run is a few seconds; the launch is most of it)."""
    return reference_job(request.param, tmp_path_factory)[0]


def assert_same_run(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert len(got["losses"]) == len(want["losses"]) > 0
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"{what}: step {step} loss {a!r} vs {b!r}"
    worst = max(abs(a - b) for p, q in zip(got["parameters"], want["parameters"], strict=True)
                for a, b in zip(p, q, strict=True))
    assert worst <= WEIGHT_ATOL, f"{what}: final weights differ by up to {worst:.2e}"


def test_the_reference_run_clips_on_some_steps_and_not_on_others(report):
    # so that the comparisons below cover DeepSpeed's clipping as well as its unclipped steps
    norms = report["runs"]["reference"]["grad_norms"]
    assert min(norms) < 1.0 < max(norms), norms


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_in_fp32_trains_as_ddp_with_torch_adamw_does(report, stage):
    runs = report["runs"]
    assert runs[f"zero{stage}"]["skipped_steps"] == 0
    assert_same_run(runs[f"zero{stage}"], runs["reference"], f"ZeRO-{stage} vs DDP + AdamW")


def test_two_micro_batches_of_4_accumulated_equal_one_micro_batch_of_8(report):
    runs = report["runs"]
    assert_same_run(runs["gas2_mb4"], runs["gas1_mb8"], "GAS 2 x mb 4 vs GAS 1 x mb 8")
    assert runs["gas2_mb4"]["global_steps"] == runs["gas1_mb8"]["global_steps"] == len(runs["gas1_mb8"]["losses"])


def test_fp16_overflow_skips_the_step_halves_the_scale_and_training_goes_on(report):
    run, overflow = report["runs"]["fp16_overflow"], report["overflow_step"]
    scales, after = run["scales"], run["parameters_after_each_step"]
    assert scales[:overflow] == [report["initial_scale"]] * overflow
    assert scales[overflow:] == [report["initial_scale"] / 2] * (len(scales) - overflow)  # hysteresis 1
    assert run["skipped_steps"] == 1
    assert after[overflow] == after[overflow - 1], "the overflowing step changed the weights"
    for step in range(1, len(after)):
        if step != overflow:
            assert after[step] != after[step - 1], f"step {step} did not update the weights"
    finite = [x for i, x in enumerate(run["losses"]) if i != overflow]
    assert all(math.isfinite(x) for x in finite), run["losses"]
    # fp16 rounding aside, the steps before the overflow follow the fp32 run
    for a, b in zip(run["losses"][:overflow], report["runs"]["reference"]["losses"][:overflow], strict=True):
        assert math.isclose(a, b, rel_tol=1e-3), (a, b)


# -- resume: a fresh engine, from other weights and another RNG state, loads a checkpoint and continues ---------------

RESUMES = ["zero2_offload_warmup_decay", "zero1_bf16", "zero1_fp16_after_an_overflow"]


@pytest.mark.parametrize("case", RESUMES)
def test_a_resumed_run_reproduces_the_uninterrupted_losses_exactly(report, case):
    run, save_after = report["resumes"][case], report["save_after"]
    assert run["resumed"] == run["uninterrupted"][save_after:]  # ==, not close: same arithmetic, same draws


def test_the_resume_is_exact_only_because_the_rng_state_came_back_through_the_accelerator(report):
    # control: the same resume without restoring each rank's RNG state draws other dropout masks
    run, save_after = report["resumes"]["zero2_offload_warmup_decay"], report["save_after"]
    assert run["resumed_without_rng"][0] != run["uninterrupted"][save_after]


def test_the_warmup_decay_schedule_resumes_where_it_was(report):
    lrs = report["resumes"]["zero2_offload_warmup_decay"]["lrs"]
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[2]  # warm-up, then decay: a resume at the wrong step shows


def test_the_loss_scale_after_an_overflow_is_restored_not_reset(report):
    run = report["resumes"]["zero1_fp16_after_an_overflow"]
    assert run["saved_scale"] == report["initial_scale"] / 2 == run["scale_after_load"]


def test_activation_checkpointing_with_dropout_computes_what_the_uncheckpointed_model_does(report):
    runs = report["runs"]
    checkpointed, plain = runs["dropout_checkpointed"], runs["dropout_not_checkpointed"]
    assert checkpointed["block_forwards_per_step"] == 2 * plain["block_forwards_per_step"] == 4  # recomputed
    assert checkpointed["losses"] == plain["losses"]  # the recompute drew the forward's dropout masks again
    assert checkpointed["parameters"] == plain["parameters"]
    assert runs["dropout_checkpointed_other_seed"]["losses"] != checkpointed["losses"]  # dropout is really on


def test_two_pipeline_stages_train_as_the_whole_model_does_in_one_process(report):
    run = report["runs"]["pipeline"]
    assert run["stage_layers"] == [0, 4]  # rank 0 holds layers 0-3 (of 7), rank 1 the rest: really split
    assert len(run["losses"]) == len(run["reference_losses"]) > 0
    for step, (a, b) in enumerate(zip(run["losses"], run["reference_losses"], strict=True)):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"pipeline: step {step} loss {a!r} vs {b!r}"
    assert run["max_weight_difference"] <= PIPELINE_WEIGHT_ATOL


def test_moe_with_expert_parallel_2_computes_what_the_whole_network_does_in_one_process(report):
    run = report["runs"]["moe"]
    assert run["experts_differ"]  # one expert per rank, each its own weights: misrouted tokens would show
    assert all(sum(counts[e] for counts in run["tokens_per_expert"]) > 0 for e in (0, 1)), run["tokens_per_expert"]
    for step, (a, b) in enumerate(zip(run["losses"], run["reference_losses"], strict=True)):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"MoE: step {step} loss {a!r} vs {b!r}"
    assert run["max_weight_difference"] <= WEIGHT_ATOL


# -- data-sampling curriculum learning (curriculum_sampling.py) --------------------------------------------------------

def fixed_linear(step: int) -> int:
    """DeepSpeed's documented fixed_linear schedule at global step ``step`` (difficulty_step 1: no rounding)."""
    low, high = SCHEDULE["min_difficulty"], SCHEDULE["max_difficulty"]
    return min(high, math.floor(step / SCHEDULE["total_curriculum_step"] * (high - low) + low))


def drawn(record: dict[str, Any]) -> list[tuple[int, int]]:
    return [(index, difficulty) for rank in record["samples"] for index, difficulty in rank]


def test_the_data_analyzer_indexes_each_samples_true_difficulty(report):
    assert report["runs"]["curriculum_sampling"]["analyzed"] == SEQLEN.tolist()


def test_data_sampling_curriculum_draws_only_what_the_fixed_linear_schedule_allows(report):
    steps = report["runs"]["curriculum_sampling"]["on"]["steps"]
    assert len(steps) == STEPS
    for step, record in enumerate(steps, start=1):
        allowed = fixed_linear(step)
        assert record["scheduled"] == [allowed, allowed], f"step {step}"
        samples = drawn(record)
        assert len({index for index, _ in samples}) == len(samples) == 2 * MICRO_BATCH  # ranks get disjoint halves
        assert all(difficulty == SEQLEN[index] for index, difficulty in samples)  # the batch is the sample
        assert max(difficulty for _, difficulty in samples) <= allowed, f"step {step}: {samples}"
    assert fixed_linear(1) < fixed_linear(STEPS) == SCHEDULE["max_difficulty"]


def test_without_the_curriculum_the_same_sampler_draws_harder_samples_than_the_schedule_allows(report):
    # the negative control: the difficulty check above can fail
    steps = report["runs"]["curriculum_sampling"]["off"]["steps"]
    assert any(max(d for _, d in drawn(record)) > fixed_linear(step) for step, record in enumerate(steps, start=1))


@pytest.mark.parametrize("state", ["on", "off"])
def test_the_engine_trains_on_the_batches_the_sampler_drew_as_plain_pytorch_does(report, state):
    run = report["runs"]["curriculum_sampling"][state]
    assert_same_run({"losses": [r["loss"] for r in run["steps"]], "parameters": run["parameters"]},
                    run["reference"], f"curriculum {state} vs a PyTorch replica on the drawn batches")


def test_the_autotp_inference_engine_shards_the_model_and_gives_the_unsharded_logits(report):
    run = report["runs"]["autotp"]
    assert run["up_proj_out_features"] == 4 * 32 // 2  # column-parallel: half the output features per rank
    assert run["down_proj_class"] == "LinearAllreduce"  # row-parallel: partial sums all-reduced
    assert run["logits_device"] == report["device"]
    assert run["max_logit_difference"] <= 1e-5  # fp32; measured 4.8e-7 on cpu (reduction order)


def test_zero_infinity_offloading_to_the_cpu_or_nvme_trains_as_zero3_on_the_device_does(report):
    runs = report["runs"]["infinity"]
    for offloaded in ("cpu", "nvme"):
        run, device = runs[offloaded], runs["device"]
        assert run["skipped_steps"] == 0 and run["parameters_count"] > 1_000_000
        for step, (a, b) in enumerate(zip(run["losses"], device["losses"], strict=True)):
            assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"{offloaded}: step {step} loss {a!r} vs {b!r}"
        assert run["max_weight_difference_from_device"] <= WEIGHT_ATOL


def test_zero_infinity_offloading_to_nvme_swaps_through_devshims_async_io_and_matches_cpu_offload_exactly(report):
    nvme, cpu = report["runs"]["infinity"]["nvme"], report["runs"]["infinity"]["cpu"]
    assert nvme["aio_handle_modules"] == ["devshim_core.integrations.deepspeed.aio"]
    kinds = {Path(name).parts[1] for name, _ in nvme["swap_files"]}
    assert kinds == {"float32params", "optimizer"}, nvme["swap_files"]  # parameters and optimizer state
    assert min(size for _, size in nvme["swap_files"]) >= 1 << 20
    optimizer_files = [Path(name).name for name, _ in nvme["swap_files"] if "/optimizer/" in name]
    assert any(name.startswith("exp_avg-") for name in optimizer_files)
    assert any(name.startswith("exp_avg_sq-") for name in optimizer_files)
    # the same host Adam on the same numbers: only where the bytes wait between steps differs
    assert nvme["losses"] == cpu["losses"]
    assert nvme["weights_sha256"] == cpu["weights_sha256"]


@pytest.mark.skipif(not version_in_range(metadata.version("deepspeed"), ">=0.17"),
                    reason="DeepSpeed < 0.17 converts the offloaded fp32 weights on the device: no one-pass set")
def test_zero2_bf16_offload_in_one_pass_is_bit_identical_to_deepspeeds_two_pass_step(report):
    run = report["runs"]["one_pass_offload"]
    assert run["reverted"] is True
    assert run["identical_on_every_rank"] == dict.fromkeys(
        ("fp32_master", "exp_avg", "exp_avg_sq", "bf16_weights"), True), run
    assert run["elements"]["fp32_master"] > 0
    # every step of every group was written by the host Adam and its second pass skipped; without the set, none
    done = run["steps"] * run["groups"]
    assert run["one_pass_counts"] == {"written": done, "skipped": done}, run
    assert run["two_pass_counts"] is None


def test_a_checkpoint_written_on_the_emulated_npu_resumes_on_the_cpu(tmp_path_factory):
    npu, npu_dir = reference_job(ASCEND, tmp_path_factory)
    cpu = run_reference_job(CPU, tmp_path_factory.mktemp("foreign-on-cpu"), "--load-foreign",
                            str(npu_dir / "checkpoints"))
    assert cpu["loaded"]["parameter_devices"] == ["cpu"]
    want = npu["runs"]["portable"]["uninterrupted"][npu["save_after"]:]
    for step, (a, b) in enumerate(zip(cpu["loaded"]["losses"], want, strict=True)):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"resumed on cpu, step {step}: {a!r} vs npu's {b!r}"


def one_rank_loads(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The 2-rank ZeRO-3 run's final checkpoint, converted by DeepSpeed's own tools (``zero_to_fp32`` and
    ``ds_to_universal``) and loaded by a job on 1 rank, once per session: the trained run and what was loaded."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    trained, workdir = reference_job(CPU, tmp_path_factory)
    if "one_rank" not in _jobs:
        checkpoints = workdir / "checkpoints"
        fp32 = checkpoints / "zero3_fp32.pt"
        torch.save(get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag="zero3"), fp32)
        universal = checkpoints / "zero3_universal"
        convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                  str(checkpoints / "zero3"), "--output_folder", str(universal)],
                                 capture_output=True, text=True, timeout=300)
        assert convert.returncode == 0, convert.stderr[-3000:]
        _jobs["one_rank"] = (run_reference_job(CPU, tmp_path_factory.mktemp("loads-on-1-rank"), "--load-universal",
                                               str(universal), "--load-fp32", str(fp32), ranks=1)["loaded"], workdir)
    return trained, _jobs["one_rank"][0]


def test_a_zero3_checkpoint_converted_by_zero_to_fp32_loads_into_zero1_on_one_rank(tmp_path_factory):
    # a plain fp32 state dict: what a model of any ZeRO stage, or none, loads
    trained, loaded = one_rank_loads(tmp_path_factory)
    assert loaded["fp32"]["zero_stage"] == 1
    assert loaded["fp32"]["parameters"] == trained["runs"]["zero3"]["parameters"]  # ZeRO-3 on 2 -> ZeRO-1 on 1


def test_a_zero3_checkpoint_made_universal_loads_on_one_rank(tmp_path_factory):
    # into ZeRO-3: DeepSpeed 0.19 cannot load a universal checkpoint of a ZeRO-3 run into ZeRO-1 (it looks for
    # mp_rank_00_model_states.pt; the converted folder holds ZeRO-3's zero_pp_rank_* files), on any device
    trained, loaded = one_rank_loads(tmp_path_factory)
    assert loaded["universal"]["parameters"] == trained["runs"]["zero3"]["parameters"]  # 2 ranks -> 1 rank
    assert loaded["universal"]["global_steps"] == len(trained["runs"]["zero3"]["losses"])
    assert loaded["universal"]["adam_states_nonzero"]  # the optimizer state came too, not only the weights
