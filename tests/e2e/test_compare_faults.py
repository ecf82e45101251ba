"""Spec: ``devshim compare`` finds real mistakes in a port, in unmodified scripts under real launchers.

A test plugin (``tests/plugin_fixtures/faulty_kernels.py``) answers as ``cpu_reference`` (on the host CPU) or as
``ascend`` (on the emulated npu), with one mistake planted in one kernel, the ones ports have made: an attention
mask of the wrong polarity, a wrong softmax scale, rotary embedding with its halves swapped, AdamW without bias
correction, an all-reduce that averages instead of summing. For each script (megatron-core with tensor parallelism
2, DeepSpeed ZeRO-2, an HF ``Trainer`` on DeepSpeed ZeRO-2), each of 2 ranks under ``torchrun --standalone``,
``devshim compare --steps 1`` against the host reference must name the first module and step the mistake affects,
exit 1, and, with no mistake planted, exit 0. A mistake in a kernel the script never calls changes nothing, and
``compare`` says so. One reference run per script and platform serves all its runs under test
(``--reference-from``).

The table of ``docs/compare.md`` ("What it finds") states these results; the last spec checks it against them.
``make test`` runs megatron-core on the emulated npu (a device against the host, the case ``compare`` is for) and the
``--reference kernels`` spec; ``make test-compare-matrix`` runs the rest (marker ``compare_matrix``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from plugin_fixtures import write_distribution

from .launch import REPO, job_env, venv_bin
from .platforms import ASCEND, CPU, Platform, build_emulator

pytestmark = pytest.mark.e2e

MEGATRON = ["examples/megatron_gpt.py", "--tp", "2", "--steps", "3"]
DEEPSPEED = ["examples/train_gpt.py", "--zero-stage", "2", "--steps", "3"]
HF = ["tests/e2e/hf_trainer_job.py", "--runs", "zero2", "--report", "{out}/hf-report.json"]
SCRIPTS = {"megatron-core TP 2": MEGATRON, "DeepSpeed ZeRO-2": DEEPSPEED, "HF Trainer on ZeRO-2": HF}

# (script, fault) -> the first divergence compare must name: (step, kind, module pattern); None: no divergence
EXPECTED: dict[tuple[str, str], tuple[int, str, str] | None] = {}


def compare(platform: Platform, script: list[str], out: Path, fault: str, site: Path,
            reference_from: Path | None = None) -> tuple[int, str, dict]:
    env = job_env(out.parent, platform.job_env(platform.two_devices_env))
    env.update(DEVSHIM_PLUGIN="faulty", FAULTY_BASE="cpu_reference" if platform is CPU else "ascend",
               FAULTY_KERNEL=fault, PYTHONPATH=f"{site}:{REPO / 'tests'}", OMP_NUM_THREADS="1")
    if fault == "allreduce":  # devshim's shared-memory all-reduce would sum without calling the planted one
        env["DEVSHIM_SHARED_MEMORY_COLLECTIVES"] = "0"
    command = [str(venv_bin("devshim")), "compare", "--steps", "1", "--out", str(out)]
    if reference_from is not None:
        command += ["--reference-from", str(reference_from)]
    command += ["--", str(venv_bin("torchrun")), "--standalone", "--nproc-per-node", "2",
                *[arg.format(out=out.parent) for arg in script]]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    found = json.loads((out / "compare.json").read_text()) if (out / "compare.json").exists() else {}
    return done.returncode, done.stdout + done.stderr, found


# (script, platform): the mistakes planted, each with the first divergence compare must name on every rank, as
# (step, kind, module); None: compare must find the runs the same. Megatron's attention, rotary and all-reduce
# mistakes all show first where their result is first used: its core attention (the rotary rotates q and k inside
# the self-attention, just before it) and the vocabulary-parallel embedding (its output is the first tensor-parallel
# all-reduce of the step). A mistake in AdamW shows in the first parameter it updates; one in the all-reduce of
# DeepSpeed's data-parallel gradients, in the first gradient the optimizer steps with.
CORE_ATTENTION = (0, "forward", "DistributedDataParallel.module.decoder.layers.0.self_attention.core_attention")
CASES: dict[str, dict[str, tuple[int, str, str] | None]] = {
    "megatron-core TP 2": {
        "": None, "mask": CORE_ATTENTION, "scale": CORE_ATTENTION, "rotary": CORE_ATTENTION,
        "adamw": (0, "param", "DistributedDataParallel.module.embedding.word_embeddings.weight"),
        "allreduce": (0, "forward", "DistributedDataParallel.module.embedding.word_embeddings")},
    "DeepSpeed ZeRO-2": {
        "": None, "adamw": (0, "param", "FusedAdam.group0.param0"),
        "allreduce": (0, "optimizer_grad", "FusedAdam.group0.param0"),
        "scale": None},  # the script calls torch's SDPA itself, never the plugin's attention
    "HF Trainer on ZeRO-2": {
        "": None, "adamw": (0, "param", "FusedAdam.group0.param0"),
        "allreduce": (0, "optimizer_grad", "FusedAdam.group0.param0")},
}
PLATFORMS = {"megatron-core TP 2": (CPU, ASCEND), "DeepSpeed ZeRO-2": (CPU, ASCEND),
             "HF Trainer on ZeRO-2": (CPU, ASCEND)}
PARAMS = [(script, platform) for script, platforms in PLATFORMS.items() for platform in platforms]
# make test runs megatron-core on the emulated npu (a device against the host: the case compare exists for);
# make test-compare-matrix the rest (CI's 30 minutes)
IN_CI = ("megatron-core TP 2", "npu")


def _marks(script: str, platform: Platform) -> list[pytest.MarkDecorator]:
    return [] if (script, platform.id) == IN_CI else [pytest.mark.compare_matrix]


@pytest.fixture(scope="module")
def faulty_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("faulty-site")
    write_distribution(site, "devshim-faulty", "0.0.1", {"faulty": "plugin_fixtures.faulty_kernels:faulty"})
    return site


@pytest.fixture(scope="module")
def outcomes(faulty_site: Path, tmp_path_factory: pytest.TempPathFactory):
    """(script, platform id) -> every planted mistake's (exit code, output, compare.json), each run compared with
    one reference run (the clean run's); run on first use."""
    found: dict[tuple[str, str], dict[str, tuple[int, str, dict]]] = {}

    def get(script_name: str, platform: Platform) -> dict[str, tuple[int, str, dict]]:
        if (script_name, platform.id) not in found:
            found[script_name, platform.id] = run_all(script_name, platform, faulty_site, tmp_path_factory)
        return found[script_name, platform.id]
    return get


def run_all(script_name: str, platform: Platform, site: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, dict]]:
    if platform.emulated:
        build_emulator()
    work = tmp_path_factory.mktemp(f"compare-{script_name.split()[0]}-{platform.id}")
    script = list(SCRIPTS[script_name])
    if script_name.startswith("megatron") and platform is not CPU:
        # Megatron's RNG tracker forks the device's generator, which on the host is the CPU's own: started from its
        # own initialisation, a device run and the host reference differ from the first weight (compare says so);
        # both start from weights saved once here
        init = work / "initial"
        on_host = job_env(work, CPU.job_env(dict(CPU.two_devices_env, DEVSHIM_PLUGIN="cpu_reference")))
        saved = subprocess.run([str(venv_bin("torchrun")), "--standalone", "--nproc-per-node", "2", MEGATRON[0],
                                "--tp", "2", "--steps", "1", "--save-initial", str(init)],
                               env=on_host, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]
        script += ["--load", str(init)]
    found: dict[str, tuple[int, str, dict]] = {}
    reference = None
    for fault in CASES[script_name]:
        out = work / (fault or "clean")
        code, output, report = compare(platform, script, out, fault, site, reference)
        assert code in (0, 1), output[-4000:]
        found[fault] = (code, output, report)
        reference = reference or out
    return found


def first_divergences(report: dict) -> list[tuple[int, str, str] | None]:
    return [None if rank["first_divergence"] is None else
            (rank["first_divergence"]["step"], rank["first_divergence"]["kind"], rank["first_divergence"]["module"])
            for rank in report["ranks"]]


@pytest.mark.parametrize(("script", "platform"), [pytest.param(s, p, marks=_marks(s, p), id=f"{s.split()[0]}-{p.id}")
                                                  for s, p in PARAMS])
def test_with_no_mistake_compare_finds_the_runs_the_same_and_exits_0(outcomes, script: str, platform: Platform):
    code, output, report = outcomes(script, platform)[""]
    assert code == 0 and report["diverged"] is False, output[-3000:]
    assert first_divergences(report) == [None, None]
    assert "RESULT: same within tolerance" in output


FAULTS = [(script, platform, fault) for script, platform in PARAMS for fault in CASES[script] if fault]


@pytest.mark.parametrize(("script", "platform", "fault"), [
    pytest.param(s, p, f, marks=_marks(s, p), id=f"{s.split()[0]}-{p.id}-{f}") for s, p, f in FAULTS])
def test_compare_names_the_first_module_and_step_a_planted_mistake_affects(outcomes, script: str, platform: Platform,
                                                                            fault: str) -> None:
    code, output, report = outcomes(script, platform)[fault]
    expected = CASES[script][fault]
    assert first_divergences(report) == [expected, expected], output[-3000:]
    if expected is None:
        assert code == 0 and "RESULT: same within tolerance" in output
    else:
        assert code == 1 and f"FIRST DIVERGENCE: step {expected[0]} {expected[1]} {expected[2]}" in output


def test_the_table_in_the_docs_states_these_results() -> None:
    """docs/compare.md's "What it finds" lists every case above with its first divergence, and nothing else."""
    text = (REPO / "docs" / "compare.md").read_text()
    table = text.split("<!-- cases of tests/e2e/test_compare_faults.py -->", 1)[1].split("<!-- end of cases -->")[0]
    rows = {tuple(cell.strip().strip("`") for cell in line.strip("|").split("|"))
            for line in table.strip().splitlines()[2:]}
    expected = {(script, ", ".join(p.id for p in PLATFORMS[script]), fault or "none",
                 "none: exit 0" if where is None else f"step {where[0]} {where[1]} {where[2]}")
                for script, faults in CASES.items() for fault, where in faults.items()}
    assert rows == expected


def test_against_the_devices_own_run_on_reference_kernels_compare_isolates_a_plugin_kernel(faulty_site: Path,
                                                                                         tmp_path: Path) -> None:
    """``--reference kernels``: the same emulated npu, devshim's reference kernels in place of the plugin's. The
    devices' matmuls and collectives are the same in both runs, so a clean run agrees and a wrong kernel is named
    where it is used; no saved weights are needed, both runs draw from the same device's generator."""
    build_emulator()
    found = {}
    for fault in ("", "scale"):
        out = tmp_path / (fault or "clean")
        env = job_env(tmp_path, ASCEND.job_env(dict(ASCEND.two_devices_env, DEVSHIM_PLUGIN="faulty",
                                                     FAULTY_BASE="ascend", FAULTY_KERNEL=fault,
                                                     PYTHONPATH=f"{faulty_site}:{REPO / 'tests'}")))
        done = subprocess.run([str(venv_bin("devshim")), "compare", "--steps", "1", "--reference", "kernels", "--out",
                               str(out), "--", str(venv_bin("torchrun")), "--standalone", "--nproc-per-node", "2",
                               *MEGATRON], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
        found[fault] = (done.returncode, done.stdout + done.stderr, json.loads((out / "compare.json").read_text()))
    code, output, report = found[""]
    assert code == 0 and first_divergences(report) == [None, None], output[-3000:]
    code, output, report = found["scale"]
    assert code == 1 and first_divergences(report) == [CORE_ATTENTION, CORE_ATTENTION], output[-3000:]
