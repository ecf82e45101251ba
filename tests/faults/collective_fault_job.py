"""One rank of a collective fault (``test_collective_faults``): ``python collective_fault_job.py CASE``.

The test starts every rank itself (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment), so that it sees
each rank's own outcome. A rank prints one ``RESULT {json}`` line: what its calls returned or raised, and how long
they took. ``FAULT_NO_DEVSHIM=1`` starts a rank without devshim, as a node that lacks it would.
"""

import os
import sys

if os.environ.get("FAULT_NO_DEVSHIM") != "1":
    import devshim_core.auto  # noqa: F401 - first, as in a user's script

import datetime
import json
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])
RESULT: dict[str, Any] = {"rank": RANK, "pid": os.getpid()}


def gloo(function: Callable[..., Any]) -> Callable[..., Any]:
    """torch's own function under devshim's wrappers."""
    while hasattr(function, "__devshim_original__"):
        function = function.__devshim_original__
    return function


def attempt(name: str, call: Callable[[], Any]) -> None:
    started = time.monotonic()
    try:
        call()
        RESULT[name] = {"ok": True}
    except Exception as exc:  # what the user sees is the specification
        RESULT[name] = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    RESULT[name]["seconds"] = time.monotonic() - started


def mismatched(make: Callable[[int], tuple[Callable[[], Any], torch.Tensor]]) -> None:
    """Each rank makes its own call; afterwards, whether its tensor is unchanged."""
    call, tensor = make(RANK)
    before = tensor.clone()
    attempt("call", call)
    RESULT["unchanged"] = torch.equal(before, tensor)


def sizes() -> None:
    def make(rank: int) -> tuple[Callable[[], Any], torch.Tensor]:
        t = torch.ones(1024 * (rank + 1))
        return lambda: dist.all_reduce(t), t
    mismatched(make)


def small_and_large() -> None:
    def make(rank: int) -> tuple[Callable[[], Any], torch.Tensor]:
        t = torch.ones(16 if rank == 0 else 1 << 20)
        return lambda: dist.all_reduce(t), t
    mismatched(make)


def ops() -> None:
    def make(rank: int) -> tuple[Callable[[], Any], torch.Tensor]:
        t = torch.full((4096,), float(rank + 1))
        return lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX), t
    mismatched(make)


def dtypes() -> None:
    def make(rank: int) -> tuple[Callable[[], Any], torch.Tensor]:
        t = torch.ones(4096, dtype=torch.float32 if rank == 0 else torch.bfloat16)
        return lambda: dist.all_reduce(t), t
    mismatched(make)


def gather_sizes() -> None:
    def make(rank: int) -> tuple[Callable[[], Any], torch.Tensor]:
        part = torch.full((1000 + rank,), float(rank))
        out = torch.zeros(2 * (1000 + rank))
        return lambda: dist.all_gather_into_tensor(out, part), out
    mismatched(make)


def non_contiguous_on_one_rank() -> None:
    """Legal for gloo: every rank then takes gloo's path, with gloo's result."""
    base = torch.arange(4096.0).view(64, 64) * (RANK + 1)
    ours = base.t() if RANK == 0 else base.t().contiguous()
    theirs = ours.clone() if RANK != 0 else base.clone().t()
    attempt("call", lambda: dist.all_reduce(ours))
    gloo(dist.all_reduce)(theirs)
    RESULT["equal_to_gloo"] = torch.equal(ours, theirs)


def threads() -> None:
    """Two threads, two groups, first calls in opposite order on the two ranks."""
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    results: dict[int, float] = {}

    def work(index: int) -> None:
        t = torch.full((1 << 20,), float(RANK + 1))
        dist.all_reduce(t, group=groups[index])
        results[index] = t[0].item()

    order = (0, 1) if RANK == 0 else (1, 0)
    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in order]
    started = time.monotonic()
    for worker in workers:
        worker.start()
        time.sleep(0.2)
    for worker in workers:
        worker.join(timeout=60)
    RESULT["call"] = {"ok": all(not w.is_alive() for w in workers), "seconds": time.monotonic() - started}
    RESULT["sums"] = [results.get(0), results.get(1)]


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("devshim-collectives" in line for line in f)


def group_cycles() -> None:
    from devshim_core.integrations.torch_distributed.shm_segment import SEGMENTS

    for _ in range(20):
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1 << 16), group=group)
        dist.destroy_process_group(group)
    RESULT["mapped_segments"] = SEGMENTS.mapped()
    RESULT["mappings"] = mappings()
    RESULT["call"] = {"ok": True}


def killed() -> None:
    """Rank 1 dies by SIGKILL between two collectives; rank 0 is inside the second one."""
    dist.all_reduce(torch.ones(1 << 16))
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    attempt("call", lambda: dist.all_reduce(torch.ones(1 << 16)))
    RESULT["mappings_after"] = mappings()
    attempt("again", lambda: dist.all_reduce(torch.ones(1 << 16)))


def missing() -> None:
    """Rank 1 is alive but never makes the call (another branch of the script)."""
    dist.all_reduce(torch.ones(16))
    if RANK == 1:
        time.sleep(float(os.environ["FAULT_PG_TIMEOUT"]) + 8)
        RESULT["call"] = {"ok": True}
        return
    attempt("call", lambda: dist.all_reduce(torch.ones(16)))


def agreement() -> None:
    """Nothing but init_process_group (already made) and one collective."""
    attempt("call", lambda: dist.all_reduce(torch.ones(16)))


CASES = {f.__name__: f for f in (sizes, small_and_large, ops, dtypes, gather_sizes, non_contiguous_on_one_rank,
                                 threads, group_cycles, killed, missing, agreement)}


def main() -> None:
    case = CASES[sys.argv[1]]
    timeout = datetime.timedelta(seconds=float(os.environ.get("FAULT_PG_TIMEOUT", "60")))
    started = time.monotonic()
    try:
        dist.init_process_group("gloo", timeout=timeout)
    except Exception as exc:
        RESULT["init"] = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                          "seconds": time.monotonic() - started}
        print("RESULT " + json.dumps(RESULT), flush=True)
        sys.exit(3)
    case()
    print("RESULT " + json.dumps(RESULT), flush=True)
    os._exit(0)  # the peer may be gone or wedged: no destroy_process_group, no gloo teardown


if __name__ == "__main__":
    main()
