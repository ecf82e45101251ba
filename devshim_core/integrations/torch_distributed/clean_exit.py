"""A clean exit for every rank: gloo's worker threads settle before the interpreter finalizes.

The abort this prevents ("terminate called without an active exception", SIGABRT after a successful run) was
caught in a core dump (``docs/running-at-scale.md``): a ``pt_gloo_runloop`` thread destroys a finished
collective's work object *after* the caller has moved on. When that work holds a tensor whose Python object
died first, the destructor must take the GIL to release it. If the main thread has meanwhile reached
``Py_Finalize``, CPython 3.11-3.13 ends the requesting thread with ``pthread_exit``, whose forced unwind
crosses the destructor (``noexcept``) and calls ``std::terminate`` (pytorch/pytorch#117762; PyTorch's own
atexit fix, pytorch/pytorch#179291, was withdrawn). ``destroy_process_group`` does not help: DeepSpeed and
Megatron keep the groups, so their threads live into finalization.

The exit callback releases the GIL in short sleeps until, across one whole sleep, no gloo worker thread ran
(its context-switch counts did not move) and every one is asleep: a worker that still had an object to
release would have taken the free GIL during the sleep and been counted. It gives up after ``TIMEOUT_S``,
so an exit never hangs on a worker stuck in a collective.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from devshim_core.device import Device
from devshim_core.integrations.torch_distributed import TORCH
from devshim_core.patching import PatchSet, RunAtExit

WORKER_THREAD_NAME = "pt_gloo_runloop"  # c10d names its gloo worker threads so (Linux, torch >= 2.4)
SLEEP_S = 0.005
TIMEOUT_S = 2.0
_TASKS = "/proc/self/task"

Snapshot = dict[str, tuple[str, str]]  # thread id -> (scheduler state, "voluntary/involuntary switches")


def worker_threads() -> Snapshot:
    """Every gloo worker thread of this process, with its state and context-switch counts."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:  # no procfs: nothing to observe
        return {}
    snapshot: Snapshot = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != WORKER_THREAD_NAME:
                    continue
            with open(f"{_TASKS}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # the thread ended while being read
            continue
        state = fields.get("State", "?").split()[0]
        switches = f"{fields.get('voluntary_ctxt_switches', '').strip()}/" \
                   f"{fields.get('nonvoluntary_ctxt_switches', '').strip()}"
        snapshot[tid] = (state, switches)
    return snapshot


def settle(timeout_s: float = TIMEOUT_S, sleep_s: float = SLEEP_S,
           observe: Callable[[], Snapshot] = worker_threads) -> bool:
    """Release the GIL until the gloo workers are idle; ``False`` if they were still busy at the timeout."""
    before = observe()
    if not before:
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(sleep_s)  # the GIL is free: a worker waiting for it runs now
        after = observe()
        if after == before and all(state == "S" for state, _ in after.values()):
            return True
        if time.monotonic() >= deadline:
            return False
        before = after


def _settle_at_exit(device: Device) -> Callable[[], None]:
    def settle_gloo_workers() -> None:
        settle()  # looked up at exit, not bound now: tests/test_clean_exit.py replaces it to watch it run

    return settle_gloo_workers


def patch_set(device: Device) -> PatchSet:
    return PatchSet(
        name="torch.distributed-exit",
        requires=(TORCH,),
        reason="let gloo's worker threads release finished collectives before finalization, which otherwise "
               "aborts a rank that succeeded (pytorch/pytorch#117762)",
        patches=(
            RunAtExit(name="settle-gloo-workers", make=_settle_at_exit,
                      reason="a gloo worker that needs the GIL after Py_Finalize began calls std::terminate"),
        ),
    )
