"""ZeRO-Offload end to end, honestly split: a ZeRO-2 bf16 training step with the optimizer on the host, through
devshim with all its paths on, through devshim with its shared-memory collectives off (what a vendor device sees:
its collectives never take devshim's host shared-memory path), and through DeepSpeed's own CPU accelerator.

The contenders (``bench/offload_step_worker.py``):

- ``devshim``, all paths on: cpu_reference, the one-pass host Adam (it writes the bf16 copy in the update's pass)
  and the shared-memory collectives (``torch.distributed-shared-memory``);
- ``devshim-collectives-off``: the same with ``DEVSHIM_DISABLE=torch.distributed-shared-memory``, devshim's own
  switch for a patch set (``devshim patches`` lists the set; the dedicated boolean
  ``DEVSHIM_SHARED_MEMORY_COLLECTIVES=0`` leaves the same set out): every collective is gloo's, over TCP loopback;
- ``deepspeed``: DeepSpeed's CPU accelerator as it is (``DS_ACCELERATOR=cpu``, gloo, its JIT-built ``cpu_adam``,
  then the second pass that converts the fp32 weights), including what it builds. Its shared-memory op does not
  apply to a training step: ``deepspeed/comm/torch.py`` (DeepSpeed 0.19.8) builds ``ShareMemCommBuilder``
  (``deepspeed_shm_comm``) in ``TorchBackend.__init__`` via ``build_shm_op()`` and initialises it, but the op
  registers only ``torch.ops.deepspeed.inference_all_reduce(_)``, which only ``TorchBackend.inference_all_reduce``
  calls, which only AutoTP's layers call (``module_inject/layers.py``). ZeRO-2 (``runtime/zero/stage_1_and_2.py``)
  reduces gradients and norms with ``dist.all_reduce`` and gathers weights with ``all_gather_dp_groups``, both
  ``torch.distributed``'s gloo calls. The worker counts the collectives of the warm-up steps to show it.

Each devshim contender's worker reports, before any timing, whether the ``torch.distributed-shared-memory`` set is
applied (``devshim_core.active_session()``) and how many process groups mapped a shared segment; a contender not
in the state its name says (set applied and a segment mapped for ``devshim``; set left out by ``DEVSHIM_DISABLE``
and nothing mapped for ``devshim-collectives-off``) is not measured, and the run says why.

Protocol, fixed before any number was seen (issue 30's changes, the third contender, the targets and the
profile, before any of their numbers):

- the model: ``LAYERS`` linear layers of ``WIDTH`` x ``WIDTH`` (50.4M parameters), a micro-batch of 2 rows, so
  that the optimizer step dominates the training step; ZeRO-2, bf16, ``offload_optimizer: cpu`` (pinned),
  AdamW, clipping at 1.0, 2 ranks of one thread each, the same seed and data;
- the three contenders are started, built and warmed up (``WARMUP`` steps) first, then stay resident; DeepSpeed's
  ``cpu_adam`` (and its ``deepspeed_shm_comm``) is JIT-built by the bench into the bench's extensions directory,
  never by a test;
- ``ROUNDS`` rounds; in each, each contender trains ``STEPS_PER_ROUND`` steps while the others wait, the order
  reversed every round (so that each pair of contenders alternates which goes first). A round's figure is the sum
  of its steps' wall times;
- each round gives one paired ratio per devshim contender, devshim / DeepSpeed; the result is their geometric
  mean with its bootstrap 95% interval (:mod:`bench.stats`; a t-interval until 2026-11-24, the same for every
  benchmark since). Targets (issue 30): all devshim paths on ≤ 0.40× DeepSpeed's step (a moonshot: the profile
  below shows where the rest of the step goes) and shared-memory collectives off ≤ 0.85×, so that the offload
  path earns its share on every device. Met when the whole interval is at most the target, missed when all of it
  is above, otherwise inconclusive. (Until issue 30 the one judged row was devshim ≤ 0.90×.)
- reported beside them, not judged: each contender's optimizer-step share of the step (the time in
  ``engine.step()`` over the whole step), and the largest relative difference between each devshim contender's
  losses and DeepSpeed's at the same step (the lists are kept in the details). devshim and DeepSpeed do not compute
  bit for bit the same update (each its own Adam kernel): once an fp32 master weight differs by an ulp its bf16
  copy can round the other way, so the losses may differ at bf16 resolution. The two devshim contenders should
  agree exactly (with 2 ranks the shared-memory sums equal gloo's bit for bit);
- added after a first trial run (2 rounds, on a loaded machine) showed the optimizer step at 13-15% of the
  step, and also not judged: the same paired ratio for ``engine.step()`` alone, the part the one-pass patch
  changes, for each devshim contender; added with issue 30, not judged: devshim all on against devshim with
  its collectives off (what the shared-memory collectives earn), and the profile: per contender, rank 0's mean
  seconds per step in the forward, the backward (its collectives, the rest) and ``engine.step()`` (the host
  Adam, the collectives, the rest: clipping, the conversion copies, bookkeeping), from plain wall-clock wrappers
  the worker installs alike in every contender (``--profile``).

How long it takes, on a 2-CPU machine like that of ``bench/results.json``: each contender's start, engine build
and warm-up, about half a minute (a 1.1M-parameter trial of the three took 80 s on one, shared); 8 rounds of
3 steps of about 1.3-1.5 s for each of the three, about 100 s: some 3.5-4 minutes in all, half again what the two
contenders took, plus about 3 minutes the first time for DeepSpeed's JIT builds (``cpu_adam``, about 2,
``deepspeed_shm_comm``, about 1), kept in the extensions directory.

``--quick`` runs the two devshim contenders alone on a small model, one round, with the profile: a smoke run that
builds nothing and checks the switch.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
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
PROFILE = True  # the worker's per-phase wall-clock profile (a few timers per step, alike in every contender)
SHARED_MEMORY_SET = "torch.distributed-shared-memory"
# the devshim contenders' environments: devshim's own switches, nothing else differs
CONTENDER_ENV = {
    "devshim": {"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_CPU_DEVICE_COUNT": str(RANKS)},
    "devshim-collectives-off": {"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_CPU_DEVICE_COUNT": str(RANKS),
                                "DEVSHIM_DISABLE": SHARED_MEMORY_SET},
}
LABELS = {"devshim": "devshim, all paths on (one-pass host Adam, shared-memory collectives)",
          "devshim-collectives-off": "devshim, shared-memory collectives off (gloo)",
          "deepspeed": "DeepSpeed CPU accelerator (cpu_adam)"}
# issue 30's targets, as the largest acceptable ratio devshim / DeepSpeed
TARGETS = {"devshim": (0.40, "≤ 0.40× DeepSpeed's step (moonshot)"),
           "devshim-collectives-off": (0.85, "≤ 0.85× DeepSpeed's step")}
CONTENDERS = ("deepspeed", "devshim", "devshim-collectives-off")
# the profile's parts of a step, in order; they add up to the step (rank 0's wall clock)
PHASES = ("forward", "backward collectives", "backward rest", "host Adam", "step collectives", "step rest")


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
                       WORLD_SIZE=str(RANKS), LOCAL_WORLD_SIZE=str(RANKS), **CONTENDER_ENV.get(name, {}))
            log = open(workdir / f"{name}-rank{rank}.log", "w")  # noqa: SIM115 - closed in close()
            self.logs.append(log)
            self.ranks.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--contender", name, "--width", str(width), "--layers", str(layers),
                 "--warmup", str(WARMUP), *(["--profile"] if PROFILE else [])], cwd=ROOT, env=env, text=True,
                stderr=log, stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
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

    def train(self, steps: int) -> dict[str, Any]:
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


def wrong_collectives(name: str, ready: dict[str, Any]) -> str | None:
    """Why a devshim contender's collectives are not what its name says, or ``None`` (module docstring)."""
    state = ready.get("shared_memory") or {}
    if name == "devshim" and not (state.get("patch_applied") and state.get("segments_mapped", 0) >= 1):
        return f"devshim's shared-memory collectives are not in use with all paths on: {state}"
    if name == "devshim-collectives-off" and (state.get("patch_applied") or state.get("segments_mapped")
                                              or not state.get("disabled")):
        return f"DEVSHIM_DISABLE={SHARED_MEMORY_SET} did not turn the shared-memory collectives off: {state}"
    if name == "deepspeed" and state.get("devshim_active"):
        return "devshim was imported in DeepSpeed's own contender"
    return None


def measure(width: int, layers: int, rounds: int, contenders: tuple[str, ...]) -> dict[str, Any]:
    extensions = pathlib.Path(os.environ.get("TORCH_EXTENSIONS_DIR", ROOT / ".venv" / "torch_extensions"))
    runs: dict[str, dict[str, list[Any]]] = {}
    errors: dict[str, str] = {}
    ready: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="devshim-offload-step-") as directory:
        started: dict[str, Contender] = {}
        try:
            for name in contenders:
                try:
                    contender = Contender(name, width, layers, pathlib.Path(directory), extensions)
                except RuntimeError as error:
                    errors[name] = str(error)[-600:]
                    continue
                ready[name] = contender.ready
                problem = wrong_collectives(name, contender.ready)
                if problem is None:
                    started[name] = contender
                else:
                    errors[name] = problem
                    contender.close()
            runs = {name: {"round_seconds": [], "round_optimizer_step_seconds": [], "seconds": [],
                           "optimizer_step_seconds": [], "losses": [], "phases": []} for name in started}
            for r in range(rounds):
                for name in alternating(list(started), r):
                    measured = started[name].train(STEPS_PER_ROUND)
                    runs[name]["round_seconds"].append(sum(measured["seconds"]))
                    runs[name]["round_optimizer_step_seconds"].append(sum(measured["optimizer_step_seconds"]))
                    for key in ("seconds", "optimizer_step_seconds", "losses", "phases"):
                        runs[name][key].extend(measured.get(key, []))
        finally:
            for contender in started.values():
                contender.close()
    return {"width": width, "layers": layers, "rounds": rounds, "runs": runs, "errors": errors, "ready": ready}


def profile(phases: list[dict[str, float]]) -> dict[str, float]:
    """Mean seconds per step in each part of :data:`PHASES` (module docstring)."""
    def mean(key: str) -> float:
        return statistics.fmean(step.get(key, 0.0) for step in phases)

    parts = {"forward": mean("forward") - mean("forward collectives"),
             "backward collectives": mean("backward collectives"),
             "backward rest": mean("backward") - mean("backward collectives"),
             "host Adam": mean("host Adam"), "step collectives": mean("step collectives"),
             "step rest": mean("step") - mean("host Adam") - mean("step collectives")}
    if mean("forward collectives"):
        parts["forward collectives"] = mean("forward collectives")
    return parts


def results(raw: dict[str, Any]) -> list[Result]:
    found: list[Result] = []
    runs, ready = raw["runs"], raw["ready"]
    for name, run in runs.items():
        share = sum(run["optimizer_step_seconds"]) / sum(run["seconds"])
        found.append(Note("offload_step", f"{name}: optimizer-step share of a ZeRO-2 offload bf16 step "
                                          f"({ready[name]['parameters'] / 1e6:.1f}M params)", share, "share"))
    for name in ("devshim", "devshim-collectives-off"):
        if name not in ready:
            continue
        # 0 would mean DeepSpeed's two-pass step ran under devshim
        found.append(Note("offload_step", f"{name}: warm-up steps whose bf16 copy the host Adam wrote",
                          float(ready[name]["one_pass_copies"] or 0), "steps"))
        state = ready[name]["shared_memory"]
        found.append(Note("offload_step", f"{name}: shared-memory collectives applied (1 = yes); process groups "
                                          f"with a shared segment: {state['segments_mapped']} ({SHARED_MEMORY_SET}: "
                                          f"{state['integration'] or 'no record'})",
                          float(bool(state["patch_applied"])), ""))
    if "deepspeed" in ready:
        calls = ready["deepspeed"].get("warmup_collective_calls") or {}
        found.append(Note("offload_step", "deepspeed: its shared-memory op (deepspeed_shm_comm) built and initialised "
                                          "(1 = yes); inference_all_reduce calls in the warm-up steps, the only "
                                          f"caller of the op: {calls.get('inference_all_reduce', 0)} (collectives "
                                          f"called: {', '.join(f'{k} x{v}' for k, v in sorted(calls.items()))})",
                          float(bool(ready["deepspeed"]["deepspeed_shm_comm_op"])), ""))
    for name, run in runs.items():
        if run["phases"]:
            for part, seconds in profile(run["phases"]).items():
                found.append(Note("offload_step", f"{name}: profile, {part}, seconds per step (rank 0, "
                                                  f"{len(run['phases'])} steps)", seconds, "s"))
    for name in dict.fromkeys((*CONTENDERS, *raw["errors"])):
        if name in runs or (name != "deepspeed" and name not in raw["errors"]):
            continue
        reason = raw["errors"].get(name, "not measured (--quick)").strip().splitlines() or ["failed"]
        who = "DeepSpeed's CPU accelerator" if name == "deepspeed" else name
        found.append(Note("offload_step", f"{who} not run: {reason[-1][:160]}", 0.0, ""))
    if "devshim" in runs and "devshim-collectives-off" in runs:
        found.append(Note("offload_step", "largest relative difference between devshim's losses with the shared-"
                                          "memory collectives on and off at one step",
                          largest_relative_difference(runs["devshim"]["losses"],
                                                      runs["devshim-collectives-off"]["losses"]), "rel"))
    if "deepspeed" not in runs:
        return found
    peer = runs["deepspeed"]
    params = f"{ready['deepspeed']['parameters'] / 1e6:.1f}M params"
    for name, (max_ratio, target) in TARGETS.items():
        if name not in runs:
            continue
        subject = runs[name]
        difference = largest_relative_difference(subject["losses"], peer["losses"])
        found.append(Comparison(
            group="offload_step", case=f"ZeRO-2 offload bf16 step, {params}, 2 ranks",
            subject=LABELS[name], subject_rounds=subject["round_seconds"],
            peer=LABELS["deepspeed"], peer_rounds=peer["round_seconds"], max_ratio=max_ratio, target=target,
            details={"subject": subject, "peer": peer, "ready": ready, "max_relative_loss_difference": difference}))
        found.append(Note("offload_step", f"largest relative difference between {name}'s losses and DeepSpeed's "
                                          "at one step", difference, "rel"))
        found.append(Comparison(
            group="offload_step", case=f"engine.step() alone (host Adam, copies, all-gather), {params}, 2 ranks",
            subject=LABELS[name], subject_rounds=subject["round_optimizer_step_seconds"],
            peer=LABELS["deepspeed"], peer_rounds=peer["round_optimizer_step_seconds"],
            max_ratio=max_ratio, target="added after a trial run: not judged", judged=False))
    if "devshim" in runs and "devshim-collectives-off" in runs:
        found.append(Comparison(
            group="offload_step", case=f"what the shared-memory collectives earn: the whole step, {params}, 2 ranks",
            subject=LABELS["devshim"], subject_rounds=runs["devshim"]["round_seconds"],
            peer=LABELS["devshim-collectives-off"], peer_rounds=runs["devshim-collectives-off"]["round_seconds"],
            max_ratio=1.0, target="added with issue 30: not judged", judged=False))
    return found


def run(quick: bool = False) -> list[Result]:
    if quick:
        return results(measure(256, 4, 1, ("devshim", "devshim-collectives-off")))
    return results(measure(WIDTH, LAYERS, ROUNDS, CONTENDERS))
