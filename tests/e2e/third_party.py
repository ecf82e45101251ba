"""Run third-party training code (Megatron-LM, Megatron-DeepSpeed) unmodified but for devshim's import line.

The checkouts live outside this repository and are named by environment variables; a test whose checkout is
not named is skipped. Every job goes through :mod:`tests.e2e.first_line` (``import devshim_core.auto``, then the
script as ``__main__``), under ``torchrun`` from the test virtualenv, with the environment conventions of
:mod:`tests.e2e.launch` (no inherited ``DEVSHIM_*``, one OpenMP thread per rank, a fresh rendezvous port, an
empty ``TORCH_EXTENSIONS_DIR`` and a hard timeout that kills the whole process group).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from .launch import Job, free_port, job_env, venv_bin

HERE = Path(__file__).resolve().parent
FIRST_LINE = HERE / "first_line.py"
STANDINS = HERE / "standins"
TIMEOUT_S = 240

# Megatron (both forks) logs one line per logged iteration: "... | lm loss: 4.852386E+00 | ..."
_LM_LOSS = re.compile(r"\blm loss: ([-+0-9.eEnaif]+)")
_GRAD_NORM = re.compile(r"\bgrad norm: ([-+0-9.eEnaif]+)")
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)")


def checkout(env_var: str, what: str, marker: str) -> Path:
    """The checkout named by ``env_var`` (skip the test when unset); ``marker`` is a file it must contain."""
    value = os.environ.get(env_var)
    if not value:
        pytest.skip(f"{env_var} is not set: point it at a checkout of {what}")
    path = Path(value).resolve()
    if not (path / marker).is_file():
        pytest.fail(f"{env_var}={value} is not a checkout of {what}: {marker} is missing")
    return path


def junit_outcome(case: Any) -> str:
    """``passed``, ``failed``, ``error`` or ``skipped``: a JUnit XML ``testcase`` element's outcome."""
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = "failed" if child.tag == "failure" else "error"
        elif child.tag == "skipped":
            outcome = "skipped"
    return outcome


def require_modules(*names: str, why: str) -> None:
    """Skip when a Python dependency of the third-party code is not importable by the test's interpreter."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed ({why})")


def python_path(*entries: Path | str) -> str:
    return os.pathsep.join(str(e) for e in entries if str(e))


def run_torchrun(argv: Sequence[str], workdir: Path, *, nproc: int, env: Mapping[str, str] | None = None,
                 timeout_s: float = TIMEOUT_S, cwd: Path | None = None) -> Job:
    """``torchrun --nproc-per-node nproc <argv>`` in a session of its own, killed whole at the timeout."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [str(venv_bin("torchrun")), "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *argv]
    full_env = job_env(workdir, env)
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd or workdir, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun forwards it to its ranks, which it starts in sessions of their own (a SIGKILL of
        # torchrun's group alone orphans them, still running, with the rendezvous store gone)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        stderr += f"\n[killed: the job exceeded its {timeout_s} s timeout]"
        returncode = None
    return Job(launcher="torchrun", command=command, env=full_env, returncode=returncode, stdout=stdout,
               stderr=stderr, elapsed_s=time.monotonic() - start, report_path=workdir / "no-report",
               extensions_dir=Path(full_env["TORCH_EXTENSIONS_DIR"]))


def run_script(script: Path, script_args: Sequence[str], workdir: Path, *, nproc: int,
               env: Mapping[str, str] | None = None, script_dir_last: bool = False,
               timeout_s: float = TIMEOUT_S) -> Job:
    """The third-party ``script`` with ``import devshim_core.auto`` as its first line, on ``nproc`` ranks."""
    launcher = [str(FIRST_LINE), *(["--script-dir-last"] if script_dir_last else []), str(script)]
    return run_torchrun([*launcher, *script_args], workdir, nproc=nproc, env=env, timeout_s=timeout_s)


def run_python(code: str, *, env: Mapping[str, str], cwd: Path, timeout_s: float = 120) -> str:
    """A one-off helper process (e.g. a dataset builder from a checkout); fails the test with its output."""
    full_env = job_env(cwd, env)
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full_env, capture_output=True, text=True,
                            timeout=timeout_s)
    if result.returncode != 0:
        pytest.fail(f"helper process failed ({result.returncode}):\n{code}\n--- stdout ---\n{result.stdout[-4000:]}"
                    f"\n--- stderr ---\n{result.stderr[-6000:]}")
    return result.stdout


def logged(job: Job, pattern: re.Pattern[str]) -> list[float]:
    return [float(m.group(1)) for m in pattern.finditer(job.stdout)]


def lm_losses(job: Job) -> list[float]:
    """The ``lm loss`` of every logged iteration (Megatron prints them on the last rank only)."""
    return logged(job, _LM_LOSS)


def grad_norms(job: Job) -> list[float]:
    return logged(job, _GRAD_NORM)


def assert_succeeded(job: Job) -> None:
    assert job.returncode == 0, f"the job failed\n{job.tail(80)}"


def assert_losses_fell(losses: Sequence[float], iterations: int, margin: float, job: Job) -> None:
    """One finite loss per iteration, the mean of the last two at least ``margin`` nats below the first."""
    assert len(losses) == iterations, f"expected {iterations} logged losses, got {losses}\n{job.tail(80)}"
    assert all(math.isfinite(x) for x in losses), f"non-finite loss in {losses}\n{job.tail(80)}"
    end = sum(losses[-2:]) / 2
    assert end < losses[0] - margin, (f"the loss did not fall by {margin}: {losses[0]:.4f} -> {end:.4f} "
                                      f"({losses})\n{job.tail(80)}")


def assert_close(actual: Sequence[float], expected: Sequence[float], rtol: float, what: str, job: Job) -> None:
    assert len(actual) == len(expected) and actual, f"{what}: {actual} vs {expected}\n{job.tail(80)}"
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(actual, expected, strict=True))
    assert worst <= rtol, (f"{what} differ by {worst:.2e} (> rtol {rtol:.0e}):\n  got:      {list(actual)}\n"
                           f"  expected: {list(expected)}\n{job.tail(80)}")
