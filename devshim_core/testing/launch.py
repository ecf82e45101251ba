"""How the kit launches its 2-rank jobs: ``torchrun`` in a subprocess, with the caller's environment."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

JOBS = Path(__file__).parent / "jobs"
TIMEOUT_S = 600


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port nobody listens on right now, for one job's rendezvous.

    Drawn below the ephemeral range: a port the OS hands out for binding to port 0 is also handed out for the
    outgoing connections of every other job running at the same time, and one of those can take it before
    this job's server binds it.
    """
    low = _ephemeral_range()[0]
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: let the OS pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_reports(device: Any, workdir: Path, job: str) -> list[dict[str, Any]]:
    """:func:`run_two_ranks` on the plugin under test; skipped, saying why, when it has fewer than 2 devices."""
    count = device.device_count()
    if count < 2:
        pytest.skip(f"the 2-rank run needs 2 {device.type} devices; plugin {device.plugin!r} reports {count} "
                    f"(the {job} job runs where 2 or more are visible)")
    return run_two_ranks(job, workdir)


def run_two_ranks(job: str, out: Path, args: Sequence[str] = (), env: Mapping[str, str] | None = None
                  ) -> list[dict[str, Any]]:
    """Run ``jobs/<job>.py`` on 2 ranks under torchrun; each rank writes ``out/rank<N>.json``, returned in rank
    order. Fails with the job's output if it did not succeed."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(JOBS / f"{job}.py"),
               "--out", str(out), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "TORCH_EXTENSIONS_DIR": str(out / "torch_extensions"), **(env or {})}
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=out)
    assert done.returncode == 0, (f"the 2-rank {job} job failed ({done.returncode}): {' '.join(command)}\n"
                                  f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-6000:]}")
    built = sorted(str(p) for p in (out / "torch_extensions").rglob("*.so"))
    assert built == [], f"the {job} job JIT-compiled {built}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
