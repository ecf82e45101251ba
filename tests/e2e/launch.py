"""Run ``examples/train_gpt.py`` as a real 2-rank job and collect what it reports.

Each job is a subprocess of the test: ``torchrun`` or the ``deepspeed`` launcher from the virtualenv that
runs the tests, with a clean devshim environment (the caller adds the switches a test is about), one
OpenMP thread per rank, a free rendezvous port, its own empty ``TORCH_EXTENSIONS_DIR`` (so a JIT build
would be visible) and a hard timeout that kills the whole process group.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import only_the_upstream_exit_abort
from devshim_core.testing.launch import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_gpt.py"
TIMEOUT_S = 300
RANKS = 2

# inherited switches would change what a job proves; each test sets the ones it is about
_STRIPPED_ENV_PREFIXES = ("DEVSHIM_",)
_STRIPPED_ENV = frozenset({"DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "MASTER_ADDR", "MASTER_PORT", "RANK",
                           "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"})


def venv_bin(name: str) -> Path:
    """An executable of the virtualenv running the tests (where torchrun and deepspeed are installed)."""
    for directory in (Path(sys.executable).parent, REPO / ".venv" / "bin"):
        if (directory / name).exists():
            return directory / name
    raise FileNotFoundError(f"{name} is not installed next to {sys.executable} nor in {REPO / '.venv' / 'bin'}")


@dataclass
class Job:
    """A finished (or killed) launcher run."""

    launcher: str
    command: list[str]
    env: dict[str, str]
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    elapsed_s: float
    report_path: Path
    extensions_dir: Path

    @property
    def output(self) -> str:
        return f"{self.stdout}\n{self.stderr}"

    def tail(self, lines: int = 60) -> str:
        def last(text: str) -> str:
            return "\n".join(text.splitlines()[-lines:])

        return (f"command: {' '.join(self.command)}\nexit code: {self.returncode}, {self.elapsed_s:.1f} s\n"
                f"--- stdout (last {lines} lines) ---\n{last(self.stdout)}\n"
                f"--- stderr (last {lines} lines) ---\n{last(self.stderr)}")

    def report(self, tolerate_upstream_exit_abort: bool = False) -> dict[str, Any]:
        """Rank 0's JSON report; fails with the job's output tail if the job did not succeed.

        ``tolerate_upstream_exit_abort`` is for jobs run *without* devshim (a peer): their ranks are exposed to
        PyTorch's exit abort, which devshim prevents in its own jobs. A job that failed only by that abort,
        after rank 0 wrote its report, is then accepted with a warning.
        """
        if tolerate_upstream_exit_abort and only_the_upstream_exit_abort(self.returncode, self.stderr) \
                and self.report_path.exists():
            warnings.warn(f"the {self.launcher} job (run without devshim) hit PyTorch's exit abort "
                          "(pytorch/pytorch#117762) after writing its report", stacklevel=2)
        else:
            assert self.returncode == 0, f"the {self.launcher} job failed\n{self.tail()}"
        assert self.report_path.exists(), f"the {self.launcher} job wrote no report\n{self.tail()}"
        return json.loads(self.report_path.read_text())

    def compiled_extensions(self) -> list[str]:
        """Whatever landed in the job's TORCH_EXTENSIONS_DIR: a JIT build of a DeepSpeed/torch op."""
        if not self.extensions_dir.exists():
            return []
        return sorted(str(p.relative_to(self.extensions_dir)) for p in self.extensions_dir.rglob("*"))


def job_env(workdir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _STRIPPED_ENV and not k.startswith(_STRIPPED_ENV_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR=str(workdir / "torch_extensions"))
    env.update(extra or {})
    return env


def run_job(launcher: str, script_args: Sequence[str], workdir: Path, env: Mapping[str, str] | None = None,
            launcher_args: Sequence[str] = (), timeout_s: float = TIMEOUT_S, script: Path = SCRIPT,
            ranks: int = RANKS, report: bool = True) -> Job:
    """Train with ``launcher`` ("torchrun" or "deepspeed") in ``workdir``; rank 0 reports to workdir/report.json.

    torchrun is told the rank count; the deepspeed launcher is not (it sizes the job from the accelerator's
    device count unless ``launcher_args`` say otherwise).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    report_path = workdir / "report.json"
    port = str(free_port())
    if launcher == "torchrun":
        command = [str(venv_bin("torchrun")), "--nnodes", "1", "--nproc-per-node", str(ranks),
                   "--master-addr", "127.0.0.1", "--master-port", port, *launcher_args]
    elif launcher == "deepspeed":
        command = [str(venv_bin("deepspeed")), "--master_addr", "127.0.0.1", "--master_port", port, *launcher_args]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    command += [str(script), *script_args, *(["--report", str(report_path)] if report else [])]
    full_env = job_env(workdir, env)

    start = time.monotonic()
    # a session of its own, so a timeout can kill the launcher and every rank it spawned
    proc = subprocess.Popen(command, cwd=workdir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[killed: the job exceeded its {timeout_s} s timeout]"
        returncode = None
    return Job(launcher=launcher, command=command, env=full_env, returncode=returncode, stdout=stdout,
               stderr=stderr, elapsed_s=time.monotonic() - start, report_path=report_path,
               extensions_dir=Path(full_env["TORCH_EXTENSIONS_DIR"]))


def assert_loss_fell(losses: Sequence[float], steps: int, margin: float, job: Job) -> None:
    """``steps`` finite losses, the last at least ``margin`` nats below the first."""
    assert len(losses) == steps, f"expected {steps} losses, got {losses}\n{job.tail()}"
    assert all(math.isfinite(x) for x in losses), f"non-finite loss in {losses}\n{job.tail()}"
    assert losses[-1] < losses[0] - margin, (f"the loss did not fall by {margin}: {losses[0]:.4f} -> "
                                             f"{losses[-1]:.4f} over {steps} steps ({losses})\n{job.tail()}")
