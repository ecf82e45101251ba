"""Megatron-LM's own unit tests for tensor parallelism and the DDP grad buffers, run through devshim under torchrun.

Needs ``MEGATRON_LM_PATH``: a checkout of NVIDIA/Megatron-LM at tag ``core_v0.16.1``. Megatron runs these tests
under ``torchrun`` (CI: 8 ranks; most tensor_parallel tests need 4 or 8: by default only a selection that fits 2
ranks runs here, ``MEGATRON_UNIT_TEST_RANKS=8`` runs the whole directory; see ``SUITES``); their
``Utils.initialize_distributed`` calls ``torch.cuda.set_device`` and ``init_process_group(backend='nccl')``. Here
every rank runs ``pytest`` in a process whose first import is ``devshim_core.auto`` (no conftest of ours is
involved), so devshim alone has to make that work on the selected device. ``megatron.core`` is the installed
megatron-core (``--import-mode=append`` keeps the checkout, which only contributes ``tests/``, behind
site-packages).

Each rank writes a JUnit report; every rank must report the same outcomes, nothing may fail except the tests listed
in ``EXPECTED_FAILURES`` (each with its reason), and each suite must pass at least its stated minimum.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import pytest

from .launch import job_env
from .third_party import checkout, junit_outcome, require_modules, run_torchrun, venv_bin

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core", reason="Megatron-LM's unit tests need megatron-core")

TAG = "core_v0.16.1"

# test ids (file::class::name[params], relative to the checkout) allowed to fail, with the reason
_CUDAGRAPH_RNG = ("CUDA graphs: 'Tried using cudagraphs with RNG, however not detected in pytorch!' (the graph-safe "
                  "RNG tracker needs CUDA generators)")
_TE_ONLY = "TransformerEngine layers (TEColumnParallelLinear/TERowParallelLinear): TE is not installed here"
_HOST_GENERATOR = (
    "cpu_reference only: the device's generator IS torch's CPU generator. The test seeds the CPU generator (42), then "
    "model_parallel_cuda_manual_seed(41) ('intentionally different') to show that use_cpu_initialization ignores the "
    "device seed; on the CPU device that call reseeds the very generator the CPU initialisation draws from. A device "
    "with a generator of its own (CUDA, NPU, the emulated devices) keeps them apart")
EXPECTED_FAILURES: dict[str, str] = {
    "tests/unit_tests/tensor_parallel/test_random.py::test_double_fork_cuda_rng_states_tracker[True]": _CUDAGRAPH_RNG,
    "tests/unit_tests/tensor_parallel/test_random.py::test_convert_cuda_rng_state": _CUDAGRAPH_RNG,
    "tests/unit_tests/tensor_parallel/test_initialization.py::Test::test_te_col_init": _TE_ONLY,
    "tests/unit_tests/tensor_parallel/test_initialization.py::Test::test_te_row_init": _TE_ONLY,
    "tests/unit_tests/tensor_parallel/test_initialization.py::Test::test_embedding_init": _HOST_GENERATOR,
    "tests/unit_tests/tensor_parallel/test_initialization.py::Test::test_row_init": _HOST_GENERATOR,
    "tests/unit_tests/tensor_parallel/test_initialization.py::Test::test_col_init": _HOST_GENERATOR,
}

TENSOR_PARALLEL = "tests/unit_tests/tensor_parallel"
# Most tensor_parallel tests call Utils.initialize_model_parallel(8, ...), (4, 2), (2, 4) or (4, 1) and fail with
# "world_size (2) is not divisible by 8" on fewer ranks: the whole directory needs Megatron's CI size, 8 ranks. On a
# 2-core machine 8 ranks take ~1-2 min per test (every initialize_model_parallel builds a dozen gloo groups among 8
# oversubscribed processes): run it with MEGATRON_UNIT_TEST_RANKS=8 (timeout 3600 s). By default (2 ranks) only the
# tests that fit 2 ranks run - this selection (they use TP 1 or no model parallelism, or size themselves by the
# world size); the 4- and 8-rank tests are not run at all in that mode.
TENSOR_PARALLEL_TWO_RANKS = (
    f"{TENSOR_PARALLEL}/test_random.py::test_cuda_rng_states_tracker",
    f"{TENSOR_PARALLEL}/test_random.py::test_double_fork_cuda_rng_states_tracker",  # [True] is an expected failure
    f"{TENSOR_PARALLEL}/test_random.py::test_convert_cuda_rng_state",  # expected failure
    f"{TENSOR_PARALLEL}/test_random.py::test_checkpoint",
    f"{TENSOR_PARALLEL}/test_random.py::test_checkpoint_without_output",
    f"{TENSOR_PARALLEL}/test_layers.py::test_LinearWithFrozenWeight[1-False]",
    f"{TENSOR_PARALLEL}/test_tensor_parallel_utils.py::test_split_tensor_along_last_dim",
    f"{TENSOR_PARALLEL}/test_tensor_parallel_utils.py::test_vocab",
)
TP_RANKS = int(os.environ.get("MEGATRON_UNIT_TEST_RANKS", "2"))

# suite: (pytest targets, ranks, minimum passed per rank, timeout per launch, items per launch or None for one
# launch). Counts measured on 2 cores (docs/megatron-third-party.md): tensor_parallel at 2 ranks, the selection: 7
# passed, 2 expected failures (9 items); at 8 ranks, the directory (27 items): 20 passed, 7 expected failures.
# test_param_and_grad_buffer.py (74 items) builds a fresh set of gloo groups in every test and never destroys them
# (Utils.destroy_model_parallel only drops the references): in one process each rank piles up thousands of threads
# and the machine starves, so it runs in launches of CHUNK items, each a fresh pair of processes (8-rank
# tensor_parallel: 4 per launch).
CHUNK = 12
SUITES = {
    "tensor_parallel": ((TENSOR_PARALLEL,) if TP_RANKS >= 8 else TENSOR_PARALLEL_TWO_RANKS, TP_RANKS,
                        20 if TP_RANKS >= 8 else 7, 3600 if TP_RANKS >= 8 else 300, 4 if TP_RANKS >= 8 else None),
    # 74 items: 70 pass; 4 skip themselves (several distributed-optimizer instances without the distributed optimizer)
    "param_and_grad_buffer": (("tests/unit_tests/distributed/test_param_and_grad_buffer.py",), 2, 70, 600, CHUNK),
}


@pytest.fixture(scope="module")
def megatron_lm() -> Path:
    path = checkout("MEGATRON_LM_PATH", f"NVIDIA/Megatron-LM at tag {TAG}", "tests/unit_tests/test_utilities.py")
    require_modules("six", "regex", "yaml", "click", "requests",
                    why="Megatron-LM's tests/unit_tests/conftest.py imports them (and megatron.training)")
    return path


def rank_outcomes(report: Path) -> dict[str, str]:
    """``{test id: passed|failed|error|skipped}`` from one rank's JUnit XML."""
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is "tests.unit_tests.x.test_file[.Class]": rebuild "tests/unit_tests/x/test_file.py[::Class]"
        split = next((i for i, part in enumerate(module) if part.startswith("test_")), len(module) - 1)
        test_id = "/".join(module[:split + 1]) + ".py" + "".join(f"::{p}" for p in module[split + 1:])
        test_id += f"::{case.get('name')}"
        outcomes[test_id] = junit_outcome(case)
    return outcomes


def is_expected_failure(test_id: str) -> bool:
    return any(test_id == known or test_id.startswith(known + "[") for known in EXPECTED_FAILURES)


def collect(megatron_lm: Path, targets: tuple[str, ...], workdir: Path) -> list[str]:
    """The suite's test ids (relative to the checkout), as pytest collects them with devshim active."""
    code = _pytest_main(megatron_lm, targets, ["--collect-only", "-q"])
    result = subprocess.run([str(venv_bin("python")), "-c", code], cwd=workdir, env=job_env(workdir),
                            capture_output=True, text=True, timeout=600)
    ids = [line.strip() for line in result.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    assert result.returncode == 0 and ids, f"collection failed\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return ids


def _pytest_main(megatron_lm: Path, targets: Sequence[str], extra: Sequence[str],
                 junit_dir: Path | None = None) -> str:
    """``python -c`` code: devshim first, then pytest on ``targets`` (paths relative to the checkout, or absolute
    test ids), each rank writing ``junit_dir/rank<RANK>.xml`` when given."""
    paths = [t if Path(t.split("::")[0]).is_absolute() else str(megatron_lm / t) for t in targets]
    junit = f"'--junitxml=' + os.path.join({str(junit_dir)!r}, 'rank' + os.environ['RANK'] + '.xml')," if junit_dir \
        else ""
    return textwrap.dedent(f"""
        import devshim_core.auto
        import os, sys
        import pytest
        sys.exit(pytest.main([
            *{paths!r}, "--rootdir", {str(megatron_lm)!r}, "--import-mode=append", "-o", "addopts=",
            "-p", "no:cacheprovider", *{list(extra)!r}, {junit}
        ]))
    """)


def run_launch(megatron_lm: Path, targets: Sequence[str], ranks: int, timeout_s: float,
               workdir: Path) -> tuple[dict[str, str], str]:
    """One torchrun of ``targets`` on ``ranks`` ranks: the outcomes every rank agrees on, and the output's tail."""
    reports = workdir / "reports"
    reports.mkdir(parents=True)
    code = _pytest_main(megatron_lm, targets, ["-q", "-rfE"], junit_dir=reports)
    job = run_torchrun(["--no-python", str(venv_bin("python")), "-c", code], workdir, nproc=ranks,
                       env={"MASTER_ADDR": "127.0.0.1"}, timeout_s=timeout_s)
    assert job.returncode is not None, f"the test run was killed\n{job.tail(80)}"
    per_rank = []
    for rank in range(ranks):
        report = reports / f"rank{rank}.xml"
        assert report.exists(), f"rank {rank} wrote no JUnit report\n{job.tail(120)}"
        per_rank.append(rank_outcomes(report))
    outcomes = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        assert other == outcomes, f"rank {rank} disagrees with rank 0: {set(other.items()) ^ set(outcomes.items())}"
    return outcomes, job.tail(150)


@pytest.mark.parametrize("suite", list(SUITES))
def test_megatron_unit_tests(megatron_lm: Path, suite: str, tmp_path: Path) -> None:
    targets, ranks, min_passed, timeout_s, chunk = SUITES[suite]
    launches = [targets]
    if chunk:
        ids = collect(megatron_lm, targets, tmp_path)
        launches = [tuple(str(megatron_lm / i) for i in ids[k:k + chunk]) for k in range(0, len(ids), chunk)]
    outcomes: dict[str, str] = {}
    failure_output: list[str] = []
    for n, launch in enumerate(launches):  # every launch runs, so that one failure hides no other outcome
        launched, tail = run_launch(megatron_lm, launch, ranks, timeout_s, tmp_path / f"launch{n}")
        outcomes.update(launched)
        if any(v in ("failed", "error") and not is_expected_failure(t) for t, v in launched.items()):
            failure_output.append(tail)
    if chunk:
        assert len(outcomes) == len(ids), f"{suite}: {len(ids)} collected, {len(outcomes)} reported"
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
    print(f"{suite}: {counts} in {len(launches)} launch(es)")
    print("\n".join(f"  {v}: {t}" for t, v in sorted(outcomes.items()) if v != "passed"))
    unexpected = sorted(t for t, v in outcomes.items() if v in ("failed", "error") and not is_expected_failure(t))
    assert not unexpected, f"{suite}: unexpected failures {unexpected} ({counts})\n" + "\n".join(failure_output)
    assert counts["passed"] >= min_passed, f"{suite}: only {counts} ({targets})"
