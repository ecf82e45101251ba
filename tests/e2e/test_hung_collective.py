"""Spec: when one rank never reaches a collective, the others fail within the configured timeout, with an error
naming the collective, and every process of the job exits (``hung_collective_job.py``).

The timeout is the one a DeepSpeed user sets: ``deepspeed.init_distributed(timeout=...)``. Both launchers are
covered: torchrun's agent and DeepSpeed's per-node launcher each end the sleeping rank once another failed.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

from .launch import run_job
from .platforms import CPU

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")

JOB = Path(__file__).resolve().parent / "hung_collective_job.py"
TIMEOUT_S = 5
# start-up (imports, rendezvous) plus the timeout plus the launcher's teardown, on a loaded 2-core machine
WALL_LIMIT_S = 90


def processes_with(marker: str) -> list[str]:
    """Every live process whose command line carries ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_rank_that_stops_before_an_all_reduce_fails_the_others_within_the_timeout_naming_it(launcher, tmp_path):
    marker = f"hung-{uuid.uuid4().hex}"
    env = CPU.job_env({**CPU.two_devices_env, "DEVSHIM_PLUGIN": CPU.plugin})
    if launcher == "deepspeed":
        env["DEVSHIM_AUTO"] = "1"  # the launcher sizes the job with devshim's device count
    job = run_job(launcher, ["--timeout-s", str(TIMEOUT_S), "--marker", marker], tmp_path, env=env, script=JOB,
                  report=False, timeout_s=WALL_LIMIT_S * 2)
    assert job.returncode not in (0, None), job.tail()
    entered = re.search(r"rank 0 enters the second all_reduce at ([0-9.]+)", job.stdout)
    assert entered and "rank 1 stops before the second all_reduce" in job.stdout, job.tail()
    assert ("torch.distributed.all_reduce timed out on rank 0 of the 2-rank world: a rank did not reach this "
            "all_reduce") in job.stderr, job.tail()
    assert "deepspeed.init_distributed(timeout=" in job.stderr  # how to change it
    # the transport's own words follow: devshim's shared-memory collectives (on by default for CPU jobs) name the rank
    assert (f"timed out after {TIMEOUT_S} s: rank 1 of this 2-rank group did not reach it") in job.stderr, job.tail()
    assert job.elapsed_s < WALL_LIMIT_S, job.tail()
    assert processes_with(marker) == [], "ranks outlived their launcher"
