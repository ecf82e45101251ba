"""ZeRO-Infinity's NVMe I/O: devshim's ``async_io`` op against DeepSpeed's own libaio op, write and read GB/s.

Protocol, fixed before any number was seen:

- two worker processes (``bench/file_io_worker.py``), one per contender, each holding one op handle and one
  buffer of ``MEGABYTES`` MiB from the op's ``new_cpu_locked_tensor``; the same handle configuration for both,
  DeepSpeed's defaults (1 MiB blocks, queue depth 8, one intra-op thread, overlapped events);
- ``ROUNDS`` rounds; in each, each contender writes its buffer to a fresh file in one directory of this machine's
  disk, then each reads its own file back, synchronously; the contender that goes first alternates by round. The
  files are deleted after each round. Both ops open files with O_DIRECT (devshim's for whole pages, which these
  are), so the page cache serves neither;
- per direction, each round gives one paired ratio devshim seconds / DeepSpeed seconds; the result is their
  geometric mean with its bootstrap 95% interval (:mod:`bench.stats`). Target: at least 0.9× DeepSpeed's
  bandwidth both ways, i.e. a time ratio of at most 1 / 0.9. Met when the whole interval is at most that, missed
  when all of it is above, otherwise inconclusive.

DeepSpeed's op is JIT-built by the bench (never by a test) and needs libaio's headers (Debian: libaio-dev); if it
cannot be built, the comparison is reported as not run, with the reason. ``--quick`` runs devshim's op alone on a
small file.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from bench.common import Comparison, Note, Result, environment_without_devshim
from bench.stats import alternating

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(__file__).resolve().parent / "file_io_worker.py"
MEGABYTES = 512
ROUNDS = 8
CONFIG = {"block_size": 1 << 20, "queue_depth": 8, "threads": 1}
MAX_RATIO = 1 / 0.9


class Worker:
    def __init__(self, contender: str, megabytes: int, extensions: pathlib.Path) -> None:
        env = environment_without_devshim()
        env.update(TORCH_EXTENSIONS_DIR=str(extensions), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        if contender == "devshim":
            env["DEVSHIM_PLUGIN"] = "cpu_reference"
        self.contender = contender
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), "--contender", contender, "--megabytes", str(megabytes),
             "--block-size", str(CONFIG["block_size"]), "--queue-depth", str(CONFIG["queue_depth"]),
             "--threads", str(CONFIG["threads"])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.ready = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.process.wait()
        assert self.process.stderr is not None
        raise RuntimeError(f"the {self.contender} worker ended ({self.process.returncode}):\n"
                           f"{self.process.stderr.read()[-3000:]}")

    def transfer(self, command: str, path: pathlib.Path) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{command} {path}\n")
        self.process.stdin.flush()
        return float(self._answer()["seconds"])

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
        self.process.wait(timeout=60)


def measure(megabytes: int, rounds: int, contenders: tuple[str, ...]) -> dict[str, Any]:
    extensions = pathlib.Path(os.environ.get("TORCH_EXTENSIONS_DIR", ROOT / ".venv" / "torch_extensions"))
    workers: dict[str, Worker] = {}
    errors: dict[str, str] = {}
    for contender in contenders:
        try:
            workers[contender] = Worker(contender, megabytes, extensions)
        except RuntimeError as error:
            errors[contender] = str(error).strip().splitlines()[-1] if str(error).strip() else "failed"
    seconds = {c: {"write": [], "read": []} for c in workers}
    try:
        with tempfile.TemporaryDirectory(prefix="devshim-file-io-", dir=ROOT) as directory:
            for r in range(rounds):
                order = alternating(list(workers), r)
                paths = {c: pathlib.Path(directory) / f"{c}-{r}.swp" for c in workers}
                for direction in ("write", "read"):
                    for contender in order:
                        seconds[contender][direction].append(workers[contender].transfer(direction,
                                                                                          paths[contender]))
                for path in paths.values():
                    path.unlink()
    finally:
        for worker in workers.values():
            worker.close()
    return {"megabytes": megabytes, "rounds": rounds, "seconds": seconds, "errors": errors,
            "ops": {c: w.ready for c, w in workers.items()}}


def results(raw: dict[str, Any]) -> list[Result]:
    found: list[Result] = []
    nbytes = raw["megabytes"] << 20
    for contender, times in raw["seconds"].items():
        for direction, values in times.items():
            found.append(Note("file_io", f"{contender} async_io {direction}, {raw['megabytes']} MiB, geomean "
                                         f"of {len(values)}", nbytes / statistics.geometric_mean(values) / 1e9, "GB/s"))
    if "deepspeed" not in raw["seconds"]:
        reason = raw["errors"].get("deepspeed", "not measured (--quick)")
        found.append(Note("file_io", f"DeepSpeed's libaio op not run: {reason[:120]}", 0.0, ""))
        return found
    for direction in ("write", "read"):
        subject, peer = raw["seconds"]["devshim"][direction], raw["seconds"]["deepspeed"][direction]
        found.append(Comparison(
            group="file_io", case=f"{direction} {raw['megabytes']} MiB, 1 MiB blocks, QD 8",
            subject="devshim async_io (native pool)", subject_rounds=subject,
            peer="DeepSpeed async_io (libaio)", peer_rounds=peer, max_ratio=MAX_RATIO,
            target="≥ 0.9× DeepSpeed's GB/s", details={"ops": raw["ops"]}))
    return found


def run(quick: bool = False) -> list[Result]:
    if quick:
        return results(measure(16, 2, ("devshim",)))
    return results(measure(MEGABYTES, ROUNDS, ("deepspeed", "devshim")))
