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
- each round gives one paired ratio, devshim's figure over the peer's; the result is the geometric mean of
  the 8 ratios with a 95% confidence interval from the t distribution on their logarithms (7 degrees of
  freedom, t = 2.365);
- verdict against the target (≤ 1.00×): **met** if the interval's upper bound is ≤ 1.00, **missed** if its
  lower bound is > 1.00, otherwise **inconclusive** (the runner counts only "met" as a target met).

Pairing by round cancels the slow drift of a shared machine; the geometric mean treats a ratio and its inverse
alike. The reported seconds are the geometric means of each contender's per-run figures, so their quotient is
the reported ratio. ``--quick`` skips this benchmark: two emulated 2-rank jobs cost over a minute, more than the
whole rest of the smoke run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Comparison, Result, environment_without_devshim, free_port
from bench.end_to_end import RANKS, ROOT, SCRIPT

ROUNDS, STEPS, WARMUP = 8, 70, 10
MAX_RATIO = 1.0
CONTENDERS = {  # name -> (the accelerator its report must name, its switches on top of DEVSHIM_EMULATE=ascend)
    "devshim": ("DevshimAccelerator", {}),
    "deepspeed": ("NPU_Accelerator", {"DS_ACCELERATOR": "npu", "DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM": "1"}),
}
# two-sided 95% quantiles of Student's t, by degrees of freedom
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)


def paired_ratio(subject: list[float], peer: list[float]) -> tuple[float, float, float]:
    """The geometric mean of the paired ratios ``subject[i] / peer[i]`` and its 95% t-interval (low, high)."""
    if len(subject) != len(peer) or not 2 <= len(subject) <= len(_T975) + 1:
        raise ValueError(f"need 2 to {len(_T975) + 1} pairs, got {len(subject)} and {len(peer)} figures")
    logs = [math.log(s / p) for s, p in zip(subject, peer, strict=True)]
    mean, half = statistics.fmean(logs), _T975[len(logs) - 2] * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(low: float, high: float, max_ratio: float) -> str:
    """``met`` when the whole interval is within the target, ``missed`` when all of it is beyond, else inconclusive."""
    return "met" if high <= max_ratio else "missed" if low > max_ratio else "inconclusive"


@dataclass
class PairedComparison(Comparison):
    """A :class:`Comparison` judged by the confidence interval of its ratio rather than by the ratio alone."""

    ci_low: float = math.nan
    ci_high: float = math.nan

    @property
    def verdict(self) -> str:
        return verdict(self.ci_low, self.ci_high, self.max_ratio)

    @property
    def met(self) -> bool:
        return self.verdict == "met"

    def as_json(self) -> dict[str, Any]:
        return {**super().as_json(), "verdict": self.verdict}


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
    if proc.returncode != 0:
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
        subprocess.run([sys.executable, "-c", "from devshim_core.emulation import build; build.load_extension()"],
                       env=_env("devshim", caches["devshim"]), cwd=ROOT, check=True, capture_output=True)
        medians: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        losses: dict[str, list[float]] = {}
        for round_ in range(ROUNDS):
            for name in ("deepspeed", "devshim")[:: 1 if round_ % 2 == 0 else -1]:
                report = _train(name, caches[name], workdir)
                medians[name].append(statistics.median(report["step_seconds"][WARMUP:]))
                losses.setdefault(name, report["losses"])
        ratio, low, high = paired_ratio(medians["devshim"], medians["deepspeed"])
        compiled = {name: sorted(p.name for p in cache.rglob("*") if p.is_file()) for name, cache in caches.items()}
    geomean = {name: statistics.geometric_mean(values) for name, values in medians.items()}
    result = PairedComparison(
        group="vendor_peer",
        case=f"emulated npu, steady step time, ZeRO-2 fp32, {RANKS} ranks (geomean of {ROUNDS} paired ratios, "
             f"95% CI {low:.3f}-{high:.3f}×)",
        subject="devshim (ascend plugin)", subject_seconds=geomean["devshim"],
        peer="DeepSpeed NPU_Accelerator", peer_seconds=geomean["deepspeed"], max_ratio=MAX_RATIO,
        target="≤ 1.00× (95% CI upper bound)", ci_low=low, ci_high=high,
        details={"rounds": ROUNDS, "steps": STEPS, "warmup": WARMUP, "median_per_run": medians,
                 "ratio_per_round": [d / p for d, p in zip(medians["devshim"], medians["deepspeed"], strict=True)],
                 "geomean_ratio": ratio, "compiled": compiled,
                 "max_loss_rel_diff": max(abs(d - p) / abs(p) for d, p in
                                         zip(losses["devshim"], losses["deepspeed"], strict=True))})
    return [result]
