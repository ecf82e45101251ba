"""End to end on the emulated npu: devshim's ascend plugin against DeepSpeed's own ``NPU_Accelerator``.

Both contenders run ``examples/train_gpt.py`` (ZeRO-2, fp32, DeepSpeed's FusedAdam, 2 ranks with one thread
each, ``torch.distributed.run``) with ``DEVSHIM_EMULATE=ascend``, so both train on devshim's emulated ``npu``
device and its emulated ``hccl`` backend: the same device, the same collectives, the same kernels except the
optimizer step. devshim's side imports ``devshim_core.auto`` (the ascend plugin drives DeepSpeed); the peer runs
the script without that line (``DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM=1``) on DeepSpeed's NPU accelerator
(``DS_ACCELERATOR=npu``), whose FusedAdam needs no compilation. Neither is Ascend hardware: this measures the
per-step cost of the two integration layers, not an NPU.

The statistic and the number of rounds were fixed before any timing was taken, and not changed after:

- a run trains 70 steps; its figure is the median step time of steps 11-70 (the first 10 are warm-up);
- a round is one run of each contender, back to back, the peer starting even rounds and devshim odd ones,
  so that neither always runs on a machine the other has just warmed; there are 8 rounds;
- each round gives one paired ratio, devshim's figure over the peer's, judged by :mod:`bench.stats` (geometric
  mean, bootstrap 95% interval) against the target ≤ 1.00×;
- the largest relative difference between the two contenders' losses is kept in the details.

Pairing by round cancels the slow drift of a shared machine; the geometric mean treats a ratio and its inverse
alike. ``--quick`` skips this benchmark: two emulated 2-rank jobs cost over a minute, more than the
whole rest of the smoke run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Comparison,
    Result,
    environment_without_devshim,
    free_port,
    largest_relative_difference,
    only_the_upstream_exit_abort,
)
from bench.end_to_end import RANKS, ROOT, SCRIPT
from bench.stats import alternating

ROUNDS, STEPS, WARMUP = 8, 70, 10
MAX_RATIO = 1.0
CONTENDERS = {  # name -> (the accelerator its report must name, its switches on top of DEVSHIM_EMULATE=ascend)
    "devshim": ("DevshimAccelerator", {}),
    "deepspeed": ("NPU_Accelerator", {"DS_ACCELERATOR": "npu", "DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM": "1"}),
}


def _env(contender: str, extensions: Path) -> dict[str, str]:
    env = environment_without_devshim()
    env.update(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(extensions), PYTHONUNBUFFERED="1",
               DEVSHIM_EMULATE="ascend", **CONTENDERS[contender][1])
    if os.environ.get("DEVSHIM_CACHE_DIR"):  # reuse the emulator this shell already built
        env["DEVSHIM_CACHE_DIR"] = os.environ["DEVSHIM_CACHE_DIR"]
    return env


def _train(contender: str, extensions: Path, workdir: Path) -> dict[str, Any]:
    """One launch; returns rank 0's report after checking that it trained on the accelerator it should have."""
    report = workdir / f"{contender}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(SCRIPT), "--zero-stage", "2", "--steps", str(STEPS),
           "--report", str(report)]
    proc = subprocess.run(cmd, env=_env(contender, extensions), cwd=ROOT, capture_output=True, text=True)
    # the peer has no exit fix; an abort after its report is PyTorch's (pytorch/pytorch#117762), not a failed run
    exit_abort = contender != "devshim" and only_the_upstream_exit_abort(proc.returncode, proc.stderr)
    if proc.returncode != 0 and not (exit_abort and report.exists()):
        raise RuntimeError(f"{contender} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(report.read_text())
    seen = {(r["accelerator"], r["device"].split(":")[0], r["dist_backend"]) for r in summary["ranks"]}
    expected = {(CONTENDERS[contender][0], "npu", "hccl")}
    if seen != expected:  # a comparison of the wrong pair would be worse than none
        raise RuntimeError(f"the {contender} run used {sorted(seen)}, not {sorted(expected)}")
    return summary


def run(quick: bool = False) -> list[Result]:
    if quick:
        return []
    with tempfile.TemporaryDirectory(prefix="devshim-bench-vendor-peer-") as tmp:
        workdir = Path(tmp)
        caches = {name: workdir / f"extensions-{name}" for name in CONTENDERS}
        # build (or find) the emulator once, before any run is timed
        subprocess.run([sys.executable, "-c", "from devshim_emulation import build; build.load_extension()"],
                       env=_env("devshim", caches["devshim"]), cwd=ROOT, check=True, capture_output=True)
        medians: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        losses: dict[str, list[float]] = {}
        for round_ in range(ROUNDS):
            for name in alternating(["deepspeed", "devshim"], round_):
                report = _train(name, caches[name], workdir)
                medians[name].append(statistics.median(report["step_seconds"][WARMUP:]))
                losses.setdefault(name, report["losses"])
        compiled = {name: sorted(p.name for p in cache.rglob("*") if p.is_file()) for name, cache in caches.items()}
    result = Comparison(
        group="vendor_peer", case=f"emulated npu, steady step time, ZeRO-2 fp32, {RANKS} ranks",
        subject="devshim (ascend plugin)", subject_rounds=medians["devshim"],
        peer="DeepSpeed NPU_Accelerator", peer_rounds=medians["deepspeed"], max_ratio=MAX_RATIO, target="≤ 1.00×",
        details={"steps": STEPS, "warmup": WARMUP, "compiled": compiled,
                 "max_loss_rel_diff": largest_relative_difference(losses["devshim"], losses["deepspeed"])})
    return [result]
