"""The ``make demo`` model under DeepSpeed through devshim against DeepSpeed's own CPU accelerator.

Same script (``examples/train_gpt.py``; the peer runs it without devshim's import line and with
``DS_ACCELERATOR=cpu``), same config (ZeRO-2, AdamW), same launcher (``torch.distributed.run``, 2 ranks,
one thread each), same seed and data. Protocol, fixed before the numbers:

- first, untimed for the ratios, one launch of the peer with an empty torch-extensions cache: DeepSpeed's CPU
  accelerator JIT-compiles its ops there (``cpu_adam``, and ``deepspeed_shm_comm``, a collective devshim does
  not use rather than one it builds faster). Its time to first step minus the peer's warm time to first step
  is reported as what it is, a one-time build cost devshim does not pay, never as a speed ratio;
- then ``ROUNDS`` paired rounds, one launch per contender each, the contender going first alternating. The peer
  launches with the extensions its first launch built, so neither side compiles anything. Each launch gives two
  figures: its time from launch to rank 0's first finished step (cold start with warm ops; target ≤ 1.05×),
  and the median of its step times after ``WARMUP`` steps (steady state; target ≤ 1.00×). Each is judged by the
  paired ratio of :mod:`bench.stats`;
- every launch's losses are compared: devshim's must be the same from launch to launch; the largest relative
  difference from the peer's, at the same step, is reported beside the ratios (each side has its own Adam
  kernel, so the two may differ in the last bits of fp32).

Not measured: a DeepSpeed built ahead of time (``DS_BUILD_OPS=1``). Its warm start would skip torch's
up-to-date check of each cached op, which the peer here still runs when it loads one.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import (
    Comparison,
    Note,
    Result,
    environment_without_devshim,
    free_port,
    largest_relative_difference,
    only_the_upstream_exit_abort,
)
from bench.stats import alternating

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_gpt.py"
RANKS = 2
ROUNDS, STEPS, WARMUP = 8, 70, 10


def _env(contender: str, extensions: pathlib.Path) -> dict[str, str]:
    env = environment_without_devshim()
    env.update(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(extensions), PYTHONUNBUFFERED="1")
    if contender == "devshim":
        env["DEVSHIM_CPU_DEVICE_COUNT"] = str(RANKS)
    else:
        env.update(DS_ACCELERATOR="cpu", DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM="1")
    return env


def _train(contender: str, extensions: pathlib.Path, steps: int, workdir: pathlib.Path) -> tuple[dict, float]:
    """One launch; returns rank 0's report and the wall-clock launch time."""
    report = workdir / f"{contender}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}", f"--master-port={free_port()}",
           str(SCRIPT), "--zero-stage", "2", "--steps", str(steps), "--report", str(report)]
    launched = time.time()
    proc = subprocess.run(cmd, env=_env(contender, extensions), cwd=ROOT, capture_output=True, text=True)
    # the peer has no exit fix; an abort after its report is PyTorch's (pytorch/pytorch#117762), not a failed run
    exit_abort = contender != "devshim" and only_the_upstream_exit_abort(proc.returncode, proc.stderr)
    if proc.returncode != 0 and not (exit_abort and report.exists()):
        raise RuntimeError(f"{contender} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(report.read_text())
    expected = {"devshim": "DevshimAccelerator", "deepspeed": "CPU_Accelerator"}[contender]
    if summary["accelerator"] != expected:  # a comparison of the wrong pair would be worse than none
        raise RuntimeError(f"the {contender} run used {summary['accelerator']}, not {expected}")
    return summary, launched


def _quick(workdir: pathlib.Path) -> list[Result]:
    """A smoke run: devshim's side only, since the peer cannot start without compiling for minutes."""
    cache = workdir / "extensions-devshim"
    report, launched = _train("devshim", cache, 4, workdir)
    return [Note(group="end_to_end", name="devshim time to first step (quick: no peer)",
                 value=report["first_step_done_at"] - launched, unit="s"),
            Note(group="end_to_end", name="devshim compiled extensions (quick)", value=len(list(cache.rglob("*.so"))),
                 unit="files")]


def run(quick: bool = False) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="devshim-bench-e2e-") as tmp:
        workdir = pathlib.Path(tmp)
        if quick:
            return _quick(workdir)
        caches = {name: workdir / f"extensions-{name}" for name in ("devshim", "deepspeed")}
        report, launched = _train("deepspeed", caches["deepspeed"], 2, workdir)
        first_launch = report["first_step_done_at"] - launched
        start: dict[str, list[float]] = {"devshim": [], "deepspeed": []}
        steady: dict[str, list[float]] = {"devshim": [], "deepspeed": []}
        losses: dict[str, list[list[float]]] = {"devshim": [], "deepspeed": []}
        for round_ in range(ROUNDS):
            for name in alternating(["deepspeed", "devshim"], round_):
                report, launched = _train(name, caches[name], STEPS, workdir)
                start[name].append(report["first_step_done_at"] - launched)
                steady[name].append(statistics.median(report["step_seconds"][WARMUP:]))
                losses[name].append(report["losses"])
        compiled = {name: sorted(p.name for p in cache.rglob("*.so")) for name, cache in caches.items()}
    if compiled["devshim"]:
        raise RuntimeError(f"devshim's launches compiled {compiled['devshim']}: the comparison is void")
    devshim_repeatable = all(run_ == losses["devshim"][0] for run_ in losses["devshim"])
    loss_difference = largest_relative_difference(losses["devshim"][0], losses["deepspeed"][0])
    cold = Comparison(
        group="end_to_end", case=f"time from launch to the first finished step, ZeRO-2, {RANKS} ranks, warm caches",
        subject="devshim (cpu_reference)", subject_rounds=start["devshim"], peer="DeepSpeed CPU accelerator, ops "
        "prebuilt", peer_rounds=start["deepspeed"], max_ratio=1.05, target="≤ 1.05×",
        details={"peer_compiled": compiled["deepspeed"]})
    return [
        cold,
        Comparison(group="end_to_end", case=f"steady step time, ZeRO-2, {RANKS} ranks (median of a launch's steps "
                   f"after {WARMUP})", subject="devshim (cpu_reference)", subject_rounds=steady["devshim"],
                   peer="DeepSpeed CPU accelerator", peer_rounds=steady["deepspeed"], max_ratio=1.0,
                   target="≤ 1.00×",
                   details={"steps": STEPS, "warmup": WARMUP, "losses": {k: v[0] for k, v in losses.items()},
                            "devshim_losses_equal_in_every_launch": devshim_repeatable,
                            "largest_relative_loss_difference": loss_difference}),
        Note(group="end_to_end", name=f"one-time JIT build of DeepSpeed's CPU ops on its first launch "
             f"({', '.join(compiled['deepspeed'])}): first launch's time to first step minus the warm one's",
             value=first_launch - cold.peer_seconds, unit="s"),
        Note(group="end_to_end", name="largest relative difference between devshim's and DeepSpeed's losses at one "
             f"step ({STEPS} steps)", value=loss_difference, unit=""),
        Note(group="end_to_end", name=f"devshim's losses equal in all {ROUNDS} launches (1 = yes)",
             value=float(devshim_repeatable), unit=""),
    ]
