"""ZeRO-Offload end to end: a ZeRO-2 bf16 training step with the optimizer on the host, through devshim (its host
Adam writes the bf16 copy in the update's pass) against DeepSpeed's own CPU accelerator (its ``cpu_adam``, then
the second pass that converts the fp32 weights).

Protocol, fixed before any number was seen:

- the model: ``LAYERS`` linear layers of ``WIDTH`` x ``WIDTH`` (50.4M parameters), a micro-batch of 2 rows, so
  that the optimizer step dominates the training step; ZeRO-2, bf16, ``offload_optimizer: cpu`` (pinned),
  AdamW, clipping at 1.0, 2 ranks of one thread each (``bench/offload_step_worker.py``), the same seed and data;
- both contenders are started, built and warmed up (``WARMUP`` steps) first, then stay resident; DeepSpeed's
  ``cpu_adam`` is JIT-built by the bench into the bench's extensions directory, never by a test;
- ``ROUNDS`` rounds; in each, each contender trains ``STEPS_PER_ROUND`` steps while the other waits, the
  contender going first alternating by round. A round's figure is the sum of its steps' wall times;
- each round gives one paired ratio devshim / DeepSpeed; the result is their geometric mean with its bootstrap
  95% interval (:mod:`bench.stats`; a t-interval until 2026-11-24, the same for every benchmark since). Target
  ≤ 0.90×: met when the whole interval is at most 0.90, missed when all of it is above, otherwise inconclusive;
- reported beside it, not judged: each contender's optimizer-step share of the step (the time in
  ``engine.step()`` over the whole step), and the largest relative difference between the two contenders' losses
  at the same step (both lists are kept in the details). The two do not compute bit for bit the same update
  (each its own Adam kernel): once an fp32 master weight differs by an ulp its bf16 copy can round the other
  way, so the losses may differ at bf16 resolution;
- added after a first trial run (2 rounds, on a loaded machine) showed the optimizer step at 13-15% of the
  step, and also not judged: the same paired ratio for ``engine.step()`` alone, the part the one-pass patch
  changes.

``--quick`` runs devshim alone on a small model, one round: a smoke run that builds nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import IO, Any

from bench.common import Comparison, Note, Result, environment_without_devshim, free_port, largest_relative_difference
from bench.stats import alternating

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(__file__).resolve().parent / "offload_step_worker.py"
RANKS = 2
WIDTH, LAYERS = 2048, 12
WARMUP, ROUNDS, STEPS_PER_ROUND = 2, 8, 3
MAX_RATIO = 0.90


class Contender:
    """One contender's ranks, resident; rank 0 takes commands on stdin and answers one JSON line each."""

    def __init__(self, name: str, width: int, layers: int, workdir: pathlib.Path, extensions: pathlib.Path) -> None:
        self.name = name
        self.logs: list[IO[str]] = []
        port = free_port()
        self.ranks: list[subprocess.Popen[str]] = []
        for rank in range(RANKS):
            env = environment_without_devshim()
            env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR=str(extensions),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(RANKS), LOCAL_WORLD_SIZE=str(RANKS))
            if name == "devshim":
                env.update(DEVSHIM_PLUGIN="cpu_reference", DEVSHIM_CPU_DEVICE_COUNT=str(RANKS))
            log = open(workdir / f"{name}-rank{rank}.log", "w")  # noqa: SIM115 - closed in close()
            self.logs.append(log)
            self.ranks.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--contender", name, "--width", str(width), "--layers", str(layers),
                 "--warmup", str(WARMUP)], cwd=ROOT, env=env, text=True, stderr=log,
                stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                stdout=subprocess.PIPE if rank == 0 else log))
        self.ready = self._answer()

    def _answer(self) -> dict[str, Any]:
        """The next ``BENCH`` line of rank 0 (DeepSpeed prints on the same stdout)."""
        assert self.ranks[0].stdout is not None
        for line in self.ranks[0].stdout:
            if line.startswith("BENCH "):
                return json.loads(line[len("BENCH "):])
        self.close()
        log = pathlib.Path(self.logs[0].name).read_text()[-3000:]
        raise RuntimeError(f"{self.name} worker ended:\n{log}")

    def train(self, steps: int) -> dict[str, list[float]]:
        assert self.ranks[0].stdin is not None
        self.ranks[0].stdin.write(f"run {steps}\n")
        self.ranks[0].stdin.flush()
        return self._answer()

    def close(self) -> None:
        stdin = self.ranks[0].stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.write("quit\n")
                stdin.close()
            except BrokenPipeError:
                pass
        for process in self.ranks:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in self.logs:
            log.close()


def measure(width: int, layers: int, rounds: int, contenders: tuple[str, ...]) -> dict[str, Any]:
    extensions = pathlib.Path(os.environ.get("TORCH_EXTENSIONS_DIR", ROOT / ".venv" / "torch_extensions"))
    runs: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, str] = {}
    ready: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="devshim-offload-step-") as directory:
        started: dict[str, Contender] = {}
        try:
            for name in contenders:
                try:
                    started[name] = Contender(name, width, layers, pathlib.Path(directory), extensions)
                    ready[name] = started[name].ready
                except RuntimeError as error:
                    errors[name] = str(error)[-600:]
            runs = {name: {"round_seconds": [], "round_optimizer_step_seconds": [], "seconds": [],
                           "optimizer_step_seconds": [], "losses": []} for name in started}
            for r in range(rounds):
                for name in alternating(list(started), r):
                    measured = started[name].train(STEPS_PER_ROUND)
                    runs[name]["round_seconds"].append(sum(measured["seconds"]))
                    runs[name]["round_optimizer_step_seconds"].append(sum(measured["optimizer_step_seconds"]))
                    for key in ("seconds", "optimizer_step_seconds", "losses"):
                        runs[name][key].extend(measured[key])
        finally:
            for contender in started.values():
                contender.close()
    return {"width": width, "layers": layers, "rounds": rounds, "runs": runs, "errors": errors, "ready": ready}


def results(raw: dict[str, Any]) -> list[Result]:
    found: list[Result] = []
    for name, run in raw["runs"].items():
        share = sum(run["optimizer_step_seconds"]) / sum(run["seconds"])
        found.append(Note("offload_step", f"{name}: optimizer-step share of a ZeRO-2 offload bf16 step "
                                          f"({raw['ready'][name]['parameters'] / 1e6:.1f}M params)", share, "share"))
    if "devshim" in raw["ready"]:  # 0 would mean DeepSpeed's two-pass step ran under devshim
        found.append(Note("offload_step", "devshim: warm-up steps whose bf16 copy the host Adam wrote",
                          float(raw["ready"]["devshim"]["one_pass_copies"] or 0), "steps"))
    if "deepspeed" not in raw["runs"]:
        reason = raw["errors"].get("deepspeed", "not measured (--quick)").strip().splitlines() or ["failed"]
        found.append(Note("offload_step", f"DeepSpeed's CPU accelerator not run: {reason[-1][:120]}", 0.0, ""))
        return found
    subject, peer = raw["runs"]["devshim"], raw["runs"]["deepspeed"]
    difference = largest_relative_difference(subject["losses"], peer["losses"])
    params = f"{raw['ready']['devshim']['parameters'] / 1e6:.1f}M params"
    found.append(Comparison(
        group="offload_step", case=f"ZeRO-2 offload bf16 step, {params}, 2 ranks",
        subject="devshim (one-pass host Adam)", subject_rounds=subject["round_seconds"],
        peer="DeepSpeed CPU accelerator (cpu_adam)", peer_rounds=peer["round_seconds"],
        max_ratio=MAX_RATIO, target="≤ 0.90× DeepSpeed's step",
        details={"subject": subject, "peer": peer, "ready": raw["ready"],
                 "max_relative_loss_difference": difference}))
    found.append(Note("offload_step", "largest relative difference between the two contenders' losses at one step",
                      difference, "rel"))
    found.append(Comparison(
        group="offload_step", case=f"engine.step() alone (host Adam, copies, all-gather), {params}, 2 ranks",
        subject="devshim (one-pass host Adam)", subject_rounds=subject["round_optimizer_step_seconds"],
        peer="DeepSpeed CPU accelerator (cpu_adam)", peer_rounds=peer["round_optimizer_step_seconds"],
        max_ratio=MAX_RATIO, target="added after a trial run: not judged", judged=False))
    return found


def run(quick: bool = False) -> list[Result]:
    if quick:
        return results(measure(256, 4, 1, ("devshim",)))
    return results(measure(WIDTH, LAYERS, ROUNDS, ("deepspeed", "devshim")))
