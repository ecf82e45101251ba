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
  slower). The crossover the thresholds in ``shared_memory.THRESHOLD_BYTES`` come from is the smallest size from
  which every row of that collective and dtype is met.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

from bench.common import Comparison, Note, Result, environment_without_devshim, free_port

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
    return found


def run(quick: bool = False) -> list[Result]:
    if quick:
        return results(measure((4 << 10, 1 << 20), 2))
    return results(measure(SIZES, ROUNDS))
