"""devshim's shared-memory collectives against gloo's own, 2 ranks of one host, per collective, dtype and size.

Protocol, fixed before any number was seen:

- one ``torchrun`` job of 2 ranks on the ``cpu_reference`` plugin, ``OMP_NUM_THREADS=1``
  (``bench/collectives_worker.py``); in it, for ``all_reduce`` (SUM), ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` (SUM), fp32 and bf16, and each size per rank in ``SIZES``: ``ROUNDS`` rounds, each
  timing a batch of calls of each contender, the one that goes first alternating by round;
- the contenders: ``torch.distributed.<name>`` with devshim active (the header exchange every call makes, then
  shared memory when the size is at least ``THRESHOLD_BYTES``) and gloo's own function, the one devshim wrapped,
  which is what the user runs without devshim;
- per row, the geometric mean of the paired per-round ratios devshim / gloo with its bootstrap 95% interval
  (:mod:`bench.stats`). Target: at most 1.00× gloo's time at every size (devshim must not make a collective
  slower);
- the crossover of shared memory against gloo, per collective and dtype (issue 30: it sets the threshold): the
  smallest measured size from which every row of that collective and dtype is met, or none when the largest is not
  (a verdict needs ``bench.stats.INTERVAL_ROUNDS`` rounds: a ``--quick`` run has none). A note gives it beside the
  threshold in use, ``shared_memory.THRESHOLD_BYTES`` (one per collective, for every dtype), and says when they
  disagree: when the measured sizes that take shared memory (at least the threshold) are not those from the
  crossover on. Rows below the threshold time the header exchange, then gloo, not shared memory: there the
  measurement says that devshim's exchange costs nothing measurable, not where shared memory starts to win.

How long it takes: 3 collectives x 2 dtypes x 6 sizes, 12 rounds of a batch of ~tens of ms per contender: a few
minutes; ``--quick`` (2 sizes, 2 rounds) about half a minute.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

from bench.common import Comparison, Note, Result, environment_without_devshim, free_port
from bench.stats import INTERVAL_ROUNDS

WORKER = pathlib.Path(__file__).resolve().parent / "collectives_worker.py"
SIZES = (256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
ROUNDS = 12
MAX_RATIO = 1.0


def measure(sizes: tuple[int, ...], rounds: int) -> dict[str, dict[str, list[float]]]:
    env = environment_without_devshim() | {"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_CPU_DEVICE_COUNT": "2",
                                           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[1])}
    with tempfile.TemporaryDirectory(prefix="devshim-bench-collectives-") as directory:
        output = pathlib.Path(directory) / "figures.json"
        torchrun = pathlib.Path(sys.executable).with_name("torchrun")
        subprocess.run([str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                        "--master-port", str(free_port()), str(WORKER), "--sizes", ",".join(map(str, sizes)),
                        "--rounds", str(rounds), "--output", str(output)], env=env, check=True, timeout=3600)
        return json.loads(output.read_text())


def results(figures: dict[str, dict[str, list[float]]]) -> list[Result]:
    from devshim_core.integrations.torch_distributed.shared_memory import THRESHOLD_BYTES

    found: list[Result] = []
    for case, times in figures.items():
        kind, dtype, nbytes = case.split()
        served = int(nbytes) >= THRESHOLD_BYTES[kind]
        found.append(Comparison(
            group="collectives", case=f"{kind} {dtype} {int(nbytes):,} B per rank, 2 ranks",
            subject="devshim (shared memory)" if served else "devshim (header exchange, then gloo)",
            subject_rounds=times["devshim"], peer="gloo (torch's own)", peer_rounds=times["gloo"],
            max_ratio=MAX_RATIO, target="≤ 1.00× gloo's time", details={"bytes_per_rank": int(nbytes)}))
    for kind, threshold in THRESHOLD_BYTES.items():
        found.append(Note("collectives", f"{kind}: smallest size per rank that takes shared memory", threshold, "B"))
    found += crossovers([r for r in found if isinstance(r, Comparison)], THRESHOLD_BYTES)
    return found


def crossover(rows: list[tuple[int, str]]) -> int | None:
    """The smallest size of ``rows`` (size, verdict) from which every row is met, or ``None``."""
    found = None
    for nbytes, verdict in sorted(rows, reverse=True):
        if verdict != "met":
            break
        found = nbytes
    return found


def crossovers(rows: list[Comparison], thresholds: dict[str, int]) -> list[Note]:
    """Per collective and dtype, the measured crossover beside the threshold in use (module docstring)."""
    by_case: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for row in rows:
        kind, dtype = row.case.split()[:2]
        by_case.setdefault((kind, dtype), []).append((row.details["bytes_per_rank"], row.verdict))
    notes = []
    for (kind, dtype), measured in by_case.items():
        sizes = sorted(nbytes for nbytes, _ in measured)
        found, threshold = crossover(measured), thresholds[kind]
        served = [n for n in sizes if n >= threshold]
        earned = [] if found is None else [n for n in sizes if n >= found]
        if min(len(row.subject_rounds) for row in rows) < INTERVAL_ROUNDS:
            agreement = f"no verdict from fewer than {INTERVAL_ROUNDS} rounds: nothing to compare"
        elif served == earned:
            agreement = "agrees with the measurement"
        elif found is None or found > threshold:
            shared = sorted(set(served) - set(earned))
            agreement = (f"DISAGREES: sizes {', '.join(f'{n:,} B' for n in shared)} take shared memory "
                         + ("though no measured size has every row from it on met" if found is None
                            else "below the measured crossover"))
        else:
            left = sorted(set(earned) - set(served))
            agreement = (f"DISAGREES: sizes {', '.join(f'{n:,} B' for n in left)} are left to gloo (after the "
                         "header exchange), though every row from there is met (below the threshold a row times "
                         "gloo: a lower threshold would measure shared memory there)")
        text = "none" if found is None else f"{found:,} B"
        notes.append(Note("collectives", f"{kind} {dtype}: crossover {text}, threshold {threshold:,} B: {agreement} "
                                         "(crossover: the smallest measured size per rank from which every row of "
                                         "this collective and dtype is met; threshold: THRESHOLD_BYTES, in use)",
                          0.0 if found is None else float(found), "" if found is None else "B"))
    return notes


def run(quick: bool = False) -> list[Result]:
    if quick:
        return results(measure((4 << 10, 1 << 20), 2))
    return results(measure(SIZES, ROUNDS))
