"""End to end: real megatron-core training on 2 ranks through devshim, on the CPU and the emulated npu and tpu.

``tests/e2e/megatron_job.py`` trains the GPT of ``examples/megatron_gpt.py`` (CUDA-written: ``set_device``,
``nccl``, ``.cuda()``) in every parallel layout from the same initial weights on the same data, with dropout 0.
Each layout must reproduce the single-rank run of the same model: the parallel splits change the order of
floating-point sums, nothing else, so the losses agree to ``RTOL`` (measured: within 2e-7 on the CPU) and the
grad norms to ``NORM_RTOL``. A resume from a ``dist_checkpointing`` checkpoint must equal the uninterrupted run
exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from .launch import Job, run_job
from .platforms import ALL, Platform, build_emulator

pytestmark = pytest.mark.e2e

JOB = Path(__file__).with_name("megatron_job.py")
RTOL = 1e-5
NORM_RTOL = 1e-4
FUSED_ADAM = "devshim_core.integrations.megatron.fused_adam.FusedAdam"
DENSE_LAYOUTS = ("tp2", "tp2_sp", "pp2_vpp2", "recompute_full", "recompute_selective", "distributed_optimizer",
                 "overlap_grad_reduce_param_gather")


@pytest.fixture(scope="module", params=ALL, ids=[p.id for p in ALL])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Platform, dict, dict]:
    platform: Platform = request.param
    if platform.emulated:
        build_emulator()
    workdir = tmp_path_factory.mktemp(f"megatron-{platform.id}")
    env = platform.job_env(platform.two_devices_env)
    single = run_job("torchrun", ["--workdir", str(workdir), "--reference"], workdir, env=env, script=JOB, ranks=1,
                     report=False, timeout_s=600)
    reference = _results(single, workdir / "reference.json")
    parallel = run_job("torchrun", ["--workdir", str(workdir)], workdir, env=env, script=JOB, ranks=2, report=False,
                       timeout_s=900)
    return platform, reference, _results(parallel, workdir / "parallel.json")


def _results(job: Job, path: Path) -> dict:
    assert job.returncode == 0, f"the megatron job failed\n{job.tail(80)}"
    assert path.exists(), f"the megatron job wrote no {path.name}\n{job.tail()}"
    return json.loads(path.read_text())


def _check(layout: str, got: dict, want: dict) -> None:
    """Losses and grad norms as the single-rank run's, on every platform."""
    problems = [f"{key} {got[key]} vs {want[key]}" for key, rtol in (("losses", RTOL), ("grad_norms", NORM_RTOL))
                if not _close(got[key], want[key], rtol)]
    assert not problems, f"{layout}: {'; '.join(problems)}"


def _close(actual: list[float], expected: list[float], rtol: float) -> bool:
    pairs = zip(actual, expected, strict=False)
    return len(actual) == len(expected) and all(math.isclose(a, e, rel_tol=rtol) for a, e in pairs)


def test_every_rank_ran_on_the_selected_plugin_device_and_backend(runs: tuple[Platform, dict, dict]) -> None:
    platform, _, parallel = runs
    ranks = parallel["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["plugin"] == platform.plugin, r
        assert r["backend"] == platform.backend, r  # the script asked for nccl
        assert r["device"] == platform.device_of_rank(r["rank"]), r  # torch.cuda.set_device(LOCAL_RANK)


def test_every_run_steps_on_the_plugins_fused_adam(runs: tuple[Platform, dict, dict]) -> None:
    """optimizer='adam' gives Megatron the FusedAdam it takes from TE or apex on CUDA, on the plugin's kernel."""
    _, reference, parallel = runs
    built = {name: run["optimizers"] for results in (reference["results"], parallel["results"])
             for name, run in results.items() if "optimizers" in run}
    assert set(built) == {"dense", "moe", *DENSE_LAYOUTS, "moe_ep2"}, built
    assert all(classes == [FUSED_ADAM] for classes in built.values()), built


def test_the_single_rank_reference_learns(runs: tuple[Platform, dict, dict]) -> None:
    _, reference, _ = runs
    for model in ("dense", "moe"):
        losses = reference["results"][model]["losses"]
        assert all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < losses[0] - 0.2, f"{model}: {losses}"  # two alternating batches, memorised


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_a_parallel_layout_reproduces_the_single_rank_run(runs: tuple[Platform, dict, dict], layout: str) -> None:
    _, reference, parallel = runs
    _check(layout, parallel["results"][layout], reference["results"]["dense"])


def test_mixture_of_experts_with_expert_parallel_2_reproduces_the_single_rank_run(
        runs: tuple[Platform, dict, dict]) -> None:
    _, reference, parallel = runs
    _check("moe_ep2", parallel["results"]["moe_ep2"], reference["results"]["moe"])


def test_a_resume_from_a_dist_checkpoint_equals_the_uninterrupted_run(runs: tuple[Platform, dict, dict]) -> None:
    _, _, parallel = runs
    straight, split = parallel["results"]["resume_straight"], parallel["results"]["resume_split"]
    assert split["losses"] == straight["losses"]
    assert split["grad_norms"] == straight["grad_norms"]
