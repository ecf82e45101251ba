"""The ``make demo`` model under DeepSpeed through devshim against DeepSpeed's own CPU accelerator.

Same script (``examples/train_gpt.py``; the peer runs it without devshim's import line and with
``DS_ACCELERATOR=cpu``), same config (ZeRO-2, AdamW), same launcher (``torch.distributed.run``, 2 ranks,
one thread each), same seed. Two measurements:

- cold time to first step: from launching the job to rank 0 finishing its first step, with an empty
  torch-extensions cache. DeepSpeed's CPU accelerator JIT-compiles its shm collectives and its CPU Adam
  here; devshim compiles nothing.
- steady-state step time: the median of every step after warm-up, pooled over several runs per
  contender, runs interleaved with the starting contender alternating; the peer runs with the extensions its
  cold run built. A step is ~30 ms and
  single steps vary by ±10% on a shared machine, so only the pooled median of hundreds of steps is compared.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import Comparison, Note, Result, environment_without_devshim, free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_gpt.py"
RANKS = 2


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
    if proc.returncode != 0:
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
                 unit="files", target="0", met=not any(cache.rglob("*.so")))]


def run(quick: bool = False) -> list[Result]:
    steps, warmup, runs = 70, 10, 8
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="devshim-bench-e2e-") as tmp:
        workdir = pathlib.Path(tmp)
        if quick:
            return _quick(workdir)
        caches = {name: workdir / f"extensions-{name}" for name in ("devshim", "deepspeed")}
        cold: dict[str, float] = {}
        for name in ("deepspeed", "devshim"):
            report, launched = _train(name, caches[name], 2, workdir)
            cold[name] = report["first_step_done_at"] - launched
        results.append(Comparison(
            group="end_to_end", case="cold time to first step (empty torch-extensions cache)",
            subject="devshim (cpu_reference)", subject_seconds=cold["devshim"],
            peer="DeepSpeed CPU accelerator", peer_seconds=cold["deepspeed"], max_ratio=0.25, target="≤ 0.25×",
            details={"peer_compiled": sorted(p.name for p in caches["deepspeed"].rglob("*.so")),
                     "devshim_compiled": sorted(p.name for p in caches["devshim"].rglob("*.so"))}))
        steady: dict[str, list[float]] = {"devshim": [], "deepspeed": []}
        medians: dict[str, list[float]] = {"devshim": [], "deepspeed": []}
        for round_ in range(runs):
            # alternate which contender starts a round, so that neither always runs on a machine the other warmed
            for name in ("deepspeed", "devshim")[:: 1 if round_ % 2 == 0 else -1]:
                report, _ = _train(name, caches[name], steps, workdir)
                steady[name].extend(report["step_seconds"][warmup:])
                medians[name].append(statistics.median(report["step_seconds"][warmup:]))
        pooled = {name: statistics.median(values) for name, values in steady.items()}
        results.append(Comparison(
            group="end_to_end",
            case=f"steady step time, ZeRO-2, {RANKS} ranks (median of {runs}x{steps - warmup} steps)",
            subject="devshim (cpu_reference)", subject_seconds=pooled["devshim"], peer="DeepSpeed CPU accelerator",
            peer_seconds=pooled["deepspeed"], max_ratio=1.0, target="≤ 1.00×",
            details={"runs": runs, "steps": steps, "warmup": warmup, "median_per_run": medians}))
    return results
