"""End to end: Megatron-LM's own ``pretrain_gpt.py``, unmodified but for ``import devshim_core.auto`` on its first line.

Needs ``MEGATRON_LM_PATH``: a checkout of NVIDIA/Megatron-LM at tag ``core_v0.16.1`` (the tag of the pinned
megatron-core 0.16.1). The checkout contributes ``megatron.training``, ``pretrain_gpt.py`` and its
``gpt_builders``/``model_provider``; ``megatron.core`` is the installed megatron-core (``megatron`` is a namespace
package there, and the checkout goes at the end of ``sys.path``: see ``first_line.py --script-dir-last``).

The import line is added without editing the checkout: ``tests/e2e/first_line.py`` imports devshim and then runs
the script as ``__main__``. The script keeps Megatron-LM's defaults for ``--distributed-backend`` (nccl) and
``--transformer-impl`` (transformer_engine): devshim has to make those work, the test does not change them.

=========================================  =====  ======================================================
job                                        ranks  proves
=========================================  =====  ======================================================
TP 2 + sequence parallel + distributed      2      the run exits 0, every iteration logs a finite loss and
optimizer                                          the loss falls
TP 2 + SP + distributed optimizer vs TP 1   2, 1   with dropout 0 and the same (CPU-initialised) weights the
                                                   parallel run computes the single-rank losses and grad
                                                   norms within ``PARALLEL_RTOL``
CP 2, ``--cp-comm-type a2a`` and ``p2p``,   2, 1   the same, with each sequence split over the 2 ranks (Ulysses
vs CP 1 on cpu, npu, tpu                           and ring attention in devshim's attention, no TE)
DP 2 + distributed optimizer, fp32 and      2      saved at iteration 4 and resumed through Megatron-LM's
bf16 on cpu; npu fp32, tpu bf16 (emulated)         own ``load_checkpoint`` (torch_dist, ``dp_reshardable``):
                                                   iterations 5..8 print the uninterrupted run's losses and
                                                   grad norms exactly
the fp32 resume with devshim's patch        2      the fault: megatron-core 0.16.1 copies the checkpoint into
``distributed-optimizer-load-without-              views of fp32 parameters without ``no_grad``; the user sees
autograd`` disabled                                the load fail with autograd's in-place error
=========================================  =====  ======================================================
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .launch import Job
from .platforms import ASCEND, CPU, SOPHGO, Platform
from .third_party import (
    assert_close,
    assert_losses_fell,
    assert_succeeded,
    checkout,
    grad_norms,
    lm_losses,
    require_modules,
    run_script,
)

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core", reason="the Megatron-LM runs need megatron-core")

TAG = "core_v0.16.1"
ITERATIONS = 8
# Mock data is (arange(n) + 1) % vocab: very learnable. Cross-entropy starts near ln(128) = 4.85 (4.88 measured,
# dropout 0) and falls by more than 0.3 nats within 8 iterations at lr 1e-3 (both tests pass this bar; with a
# 192-entry vocabulary it fell by ~0.65 from 5.3); a fall of 0.3 nats (first loss against the mean of the last two)
# is far from noise yet proves the optimizer stepped the right gradients.
LOSS_DROP = 0.3
# TP 2 + SP + distributed optimizer against TP 1 on the same weights and batches (dropout 0): only the order of
# floating-point reductions differs (split matmuls, all-reduce/reduce-scatter sums), ~1e-7 relative per step
# in fp32; 1e-4 leaves room for that to accumulate over the iterations and for the 7 printed digits.
PARALLEL_RTOL = 1e-4
# Megatron logs the grad norm as "%.3f": the same numbers may still round apart by one unit of the last digit
GRAD_NORM_ATOL = 1.01e-3

# The padded vocabulary must not depend on the TP size, or TP 1 and TP 2 are different models: Megatron-LM pads
# it to a multiple of --make-vocab-size-divisible-by x TP, and NullTokenizer's vocabulary is --vocab-size + 1 (its
# end-of-document id). 127 + 1 = 128 is a multiple of 64 x 1 and of 64 x 2: both pad to 128. (With --vocab-size 128,
# 129 padded to 192 for TP 1 and to 256 for TP 2: a larger embedding drawn first shifted every later CPU-initialised
# weight, and 64 more random logits raised the first loss from 5.28 to 5.57. That was the test, not devshim.)
VOCAB_SIZE, PADDED_VOCAB = 127, 128
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(VOCAB_SIZE), "--make-vocab-size-divisible-by", "64"]
TRAINING = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERATIONS),
            "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters", "0",
            "--eval-interval", str(10 * ITERATIONS), "--seed", "1234"]
DETERMINISTIC = ["--hidden-dropout", "0", "--attention-dropout", "0",
                 # the full weight is drawn once on the CPU and split, so every TP size starts from the same model
                 "--use-cpu-initialization"]
_PADDED_VOCAB = re.compile(r"padded vocab \(size: \d+\) with \d+ dummy tokens \(new size: (\d+)\)")
TP2_SP_DISTOPT = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"]
# Resume: 2 data-parallel ranks, so each holds half of the distributed optimizer's state (the dp_reshardable shards)
DP2_DISTOPT = ["--use-distributed-optimizer"]
RESUME_AT = ITERATIONS // 2
# A torch_dist save starts a multiprocessing "spawn" Manager, which re-runs pretrain_gpt.py without first_line.py's
# import: Megatron-LM's initialize then imports triton, which devshim's stand-in serves only where devshim is active.
# A script whose own first line is the import needs nothing; DEVSHIM_AUTO=1 is the documented switch for spawned
# children (docs/user-guide.md).
SPAWNED_CHILDREN = {"DEVSHIM_AUTO": "1"}
LOAD_PATCH = "megatron-core:distributed-optimizer-load-without-autograd"


@pytest.fixture(scope="module")
def megatron_lm() -> Path:
    path = checkout("MEGATRON_LM_PATH", f"NVIDIA/Megatron-LM at tag {TAG}", "pretrain_gpt.py")
    # megatron.training's own imports (tokenizers); not part of megatron-core's dependencies
    require_modules("six", "regex", why="megatron.training (Megatron-LM) imports them at import time")
    return path


def pretrain_gpt(checkout_path: Path, args: list[str], workdir: Path, nproc: int, platform: Platform = CPU,
                 env: dict[str, str] | None = None) -> Job:
    env = platform.job_env({**platform.two_devices_env, "DEVSHIM_PLUGIN": platform.plugin, **(env or {})})
    job = run_script(checkout_path / "pretrain_gpt.py", [*MODEL, *TRAINING, *args], workdir, nproc=nproc,
                     script_dir_last=True, env=env)
    padded = _PADDED_VOCAB.findall(job.stdout)
    assert job.returncode != 0 or padded == [str(PADDED_VOCAB)], (
        f"Megatron padded the vocabulary to {padded}, not {PADDED_VOCAB}: TP sizes would not build the same model\n"
        f"{job.tail(40)}")
    return job


def test_tp2_sequence_parallel_distributed_optimizer_trains(megatron_lm: Path, tmp_path: Path) -> None:
    job = pretrain_gpt(megatron_lm, TP2_SP_DISTOPT, tmp_path, nproc=2)
    assert_succeeded(job)
    assert_losses_fell(lm_losses(job), ITERATIONS, LOSS_DROP, job)


@pytest.mark.parametrize("platform", [CPU, ASCEND, SOPHGO], ids=["cpu", "npu", "tpu"])
def test_tp2_sequence_parallel_distributed_optimizer_matches_one_rank(megatron_lm: Path, tmp_path: Path,
                                                                      platform: Platform) -> None:
    single = pretrain_gpt(megatron_lm, DETERMINISTIC, tmp_path / "tp1", nproc=1, platform=platform)
    assert_succeeded(single)
    parallel = pretrain_gpt(megatron_lm, [*DETERMINISTIC, *TP2_SP_DISTOPT], tmp_path / "tp2", nproc=2,
                            platform=platform)
    assert_succeeded(parallel)
    ran_on = f"FIRST_LINE plugin={platform.plugin} device_type={platform.device_type} backend={platform.backend}"
    assert single.stdout.count(ran_on) == 1 and parallel.stdout.count(ran_on) == 2, parallel.tail(20)
    reference = lm_losses(single)
    assert_losses_fell(reference, ITERATIONS, LOSS_DROP, single)
    assert_same_training(parallel, single, "TP2+SP+distopt vs TP1")


def assert_same_training(parallel: Job, single: Job, label: str) -> None:
    assert_close(lm_losses(parallel), lm_losses(single), PARALLEL_RTOL, f"{label} losses", parallel)
    # grad norms are printed with 3 decimals only: equal to that resolution
    parallel_norms, reference_norms = grad_norms(parallel), grad_norms(single)
    assert len(parallel_norms) == len(reference_norms) == ITERATIONS, f"{parallel_norms} vs {reference_norms}"
    assert all(abs(a - b) <= GRAD_NORM_ATOL for a, b in zip(parallel_norms, reference_norms, strict=True)), (
        f"{label} grad norms: {parallel_norms} vs {reference_norms}\n{parallel.tail(80)}")


@pytest.mark.parametrize("platform", [CPU, ASCEND, SOPHGO], ids=["cpu", "npu", "tpu"])
def test_context_parallel_2_matches_one_rank_with_ulysses_and_ring_attention(megatron_lm: Path, tmp_path: Path,
                                                                             platform: Platform) -> None:
    """--context-parallel-size 2 without TransformerEngine: --cp-comm-type a2a (Ulysses, MindSpeed's
    ulysses_cp_algo) and p2p (ring attention, megatron_cp_algo), with Megatron-LM's own batch split and its
    dataloader's attention mask, print the single rank's losses and grad norms."""
    single = pretrain_gpt(megatron_lm, DETERMINISTIC, tmp_path / "cp1", nproc=1, platform=platform)
    assert_succeeded(single)
    assert_losses_fell(lm_losses(single), ITERATIONS, LOSS_DROP, single)
    for comm_type in ("a2a", "p2p"):
        parallel = pretrain_gpt(megatron_lm, [*DETERMINISTIC, "--context-parallel-size", "2", "--cp-comm-type",
                                              comm_type], tmp_path / f"cp2-{comm_type}", nproc=2, platform=platform)
        assert_succeeded(parallel)
        assert "data-parallel size: 1, context-parallel size: 2," in parallel.stdout, parallel.tail(40)
        assert_same_training(parallel, single, f"CP2 ({comm_type}) vs CP1")


def test_pytorch_profiler_flags_record_the_chosen_steps_on_the_chosen_ranks(megatron_lm: Path, tmp_path: Path) -> None:
    """MindSpeed's --profile/--profile-step-start/--profile-step-end/--profile-ranks are Megatron-LM's own flags;
    with --use-pytorch-profiler they drive torch.profiler, which devshim leaves to the plugin's device."""
    traces = tmp_path / "traces"
    job = pretrain_gpt(megatron_lm, [*TP2_SP_DISTOPT, "--profile", "--use-pytorch-profiler", "--profile-step-start",
                                     "2", "--profile-step-end", "4", "--profile-ranks", "0", "1",
                                     "--tensorboard-dir", str(traces)], tmp_path / "run", nproc=2)
    assert_succeeded(job)
    files = sorted(traces.glob("*.pt.trace.json"))
    assert len(files) == 2, f"one trace per profiled rank expected, got {files}\n{job.tail(40)}"
    for trace in files:
        events = json.loads(trace.read_text())["traceEvents"]
        steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"], (trace.name, steps)
        ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
        assert {"aten::mm", "aten::addmm", "aten::matmul"} & ops, sorted(ops)[:80]  # the model's GEMMs
        assert any("allreduce" in n or "all_reduce" in n for n in ops), sorted(ops)[:80]  # TP 2's collectives


def test_nsight_profiling_without_the_pytorch_profiler_is_refused_naming_the_flags(megatron_lm: Path,
                                                                                    tmp_path: Path) -> None:
    job = pretrain_gpt(megatron_lm, ["--profile", "--profile-step-start", "2", "--profile-step-end", "4"], tmp_path,
                       nproc=1)
    assert job.returncode != 0
    assert "--profile without --use-pytorch-profiler" in job.output and "--tensorboard-dir" in job.output, job.tail()


def _assert_loaded(job: Job, checkpoint: Path, iteration: int) -> None:
    assert re.search(rf"successfully loaded checkpoint from {re.escape(str(checkpoint))} .* at iteration {iteration}\b",
                     job.stdout), f"the run did not load iteration {iteration} of {checkpoint}\n{job.tail(60)}"


# both precisions on the CPU (fp32's load crashed); one each on the emulated devices, which load through the same code
@pytest.mark.parametrize(("platform", "precision"), [(CPU, "fp32"), (CPU, "bf16"), (ASCEND, "fp32"), (SOPHGO, "bf16")],
                         ids=["cpu-fp32", "cpu-bf16", "npu-fp32", "tpu-bf16"])
def test_resume_through_megatron_lm_loader_prints_the_uninterrupted_losses(megatron_lm: Path, tmp_path: Path,
                                                                           platform: Platform, precision: str) -> None:
    """Save at iteration 4 (``--save --save-interval 4``: torch_dist, the distributed optimizer's dp_reshardable
    shards), load it with ``--load --ckpt-step 4`` and train to 8: iterations 5..8 are the uninterrupted run's."""
    checkpoint = tmp_path / "checkpoint"
    args = [*DETERMINISTIC, *DP2_DISTOPT, *(["--bf16"] if precision == "bf16" else [])]
    uninterrupted = pretrain_gpt(megatron_lm, [*args, "--save", str(checkpoint), "--save-interval", str(RESUME_AT)],
                                 tmp_path / "uninterrupted", nproc=2, platform=platform, env=SPAWNED_CHILDREN)
    assert_succeeded(uninterrupted)
    resumed = pretrain_gpt(megatron_lm, [*args, "--load", str(checkpoint), "--ckpt-step", str(RESUME_AT)],
                           tmp_path / "resumed", nproc=2, platform=platform, env=SPAWNED_CHILDREN)
    assert_succeeded(resumed)
    _assert_loaded(resumed, checkpoint, RESUME_AT)
    ran_on = f"FIRST_LINE plugin={platform.plugin} device_type={platform.device_type} backend={platform.backend}"
    assert resumed.stdout.count(ran_on) == 2, resumed.tail(20)
    expected, losses = lm_losses(uninterrupted)[RESUME_AT:], lm_losses(resumed)
    assert len(expected) == len(losses) == ITERATIONS - RESUME_AT, f"{losses} vs {expected}\n{resumed.tail(60)}"
    # Megatron-LM logs a run's first iteration without resetting its loss sums (training_log's is_first_iteration),
    # so the next line prints the mean of both: as the uninterrupted run does at iteration 2. Undone here, to the
    # 7 printed digits; every other iteration is compared as printed, exactly.
    second = 2 * losses[1] - losses[0]
    assert abs(second - expected[1]) <= 2e-6 * abs(expected[1]), f"iteration {RESUME_AT + 2}: {losses} vs {expected}"
    assert [losses[0], *losses[2:]] == [expected[0], *expected[2:]], f"resumed {losses} vs uninterrupted {expected}"
    assert grad_norms(resumed) == grad_norms(uninterrupted)[RESUME_AT:], (
        f"grad norms: resumed {grad_norms(resumed)} vs uninterrupted {grad_norms(uninterrupted)}")


def test_fp32_resume_without_the_load_patch_fails_in_megatron_core_loader(megatron_lm: Path, tmp_path: Path) -> None:
    """The negative control: with devshim's patch disabled, megatron-core 0.16.1's own loader fails the resume."""
    checkpoint = tmp_path / "checkpoint"
    saved = pretrain_gpt(megatron_lm, [*DETERMINISTIC, *DP2_DISTOPT, "--train-iters", "1", "--save", str(checkpoint),
                                       "--save-interval", "1"], tmp_path / "save", nproc=2, env=SPAWNED_CHILDREN)
    assert_succeeded(saved)
    resumed = pretrain_gpt(megatron_lm, [*DETERMINISTIC, *DP2_DISTOPT, "--train-iters", "2", "--load", str(checkpoint)],
                           tmp_path / "resumed", nproc=2, env={**SPAWNED_CHILDREN, "DEVSHIM_DISABLE": LOAD_PATCH})
    assert resumed.returncode != 0, f"the resume succeeded without {LOAD_PATCH}\n{resumed.tail(40)}"
    assert "load_parameter_state_from_dp_reshardable" in resumed.output, resumed.tail(60)
    assert "a view of a leaf Variable that requires grad is being used in an in-place operation" in resumed.output, (
        resumed.tail(60))
