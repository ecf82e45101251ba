"""Spec: a rank that trained successfully also exits successfully.

gloo's worker threads can release a finished collective's tensors after the caller has moved on; doing so
once ``Py_Finalize`` has begun aborts the process (``clean_exit``'s docstring has the core dump's story).
devshim's exit callback, registered when devshim activates, releases the GIL until the workers are idle.
``python -m stress`` (``make stress``) is the evidence that it works; these specs pin down how.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from typing import Any

from plugin_fixtures import PROJECT_DIR, PYTHON, checked_json, clean_env, run

from bench.common import free_port, only_the_upstream_exit_abort
from devshim_core.integrations.torch_distributed import clean_exit
from devshim_core.integrations.torch_distributed.clean_exit import settle
from devshim_core.patching import PatchRegistry

DEVICE: Any = object()  # the exit patch does not use the device facade
IDLE = {"101": ("S", "7/0"), "102": ("S", "3/1")}


def observer(*snapshots: dict[str, tuple[str, str]]) -> Iterator[dict[str, tuple[str, str]]]:
    """What /proc shows at each look, the last one from then on."""
    yield from snapshots
    while True:
        yield snapshots[-1]


def scripted(*snapshots: dict[str, tuple[str, str]]):
    looks = observer(*snapshots)
    return lambda: next(looks)


def test_no_gloo_worker_means_no_wait():
    assert settle(timeout_s=0, observe=scripted({}))


def test_workers_that_stayed_asleep_across_a_whole_sleep_are_settled():
    assert settle(timeout_s=1, sleep_s=0, observe=scripted(IDLE, IDLE))


def test_a_worker_that_ran_during_the_sleep_is_watched_for_another_one():
    ran = {"101": ("S", "8/0"), "102": ("S", "3/1")}  # it took the GIL and went back to sleep
    looks = [IDLE, ran, ran]
    calls = []

    def observe():
        calls.append(1)
        return looks[min(len(calls), len(looks)) - 1]

    assert settle(timeout_s=1, sleep_s=0, observe=observe)
    assert len(calls) == 3  # settled only once a sleep passed without it running


def test_a_runnable_worker_is_not_settled():
    runnable = {"101": ("R", "7/0"), "102": ("S", "3/1")}
    assert not settle(timeout_s=0.02, sleep_s=0.001, observe=scripted(runnable, runnable))


def test_a_worker_busy_until_the_timeout_does_not_hang_the_exit():
    counts = (f"{i}/0" for i in range(10**6))
    assert not settle(timeout_s=0.02, sleep_s=0.001, observe=lambda: {"101": ("S", next(counts))})


def test_worker_threads_finds_the_gloo_workers_of_a_real_process_group():
    script = """\
import json, os, time
import torch, torch.distributed as dist
from devshim_core.integrations.torch_distributed.clean_exit import settle, worker_threads
before = worker_threads()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("bench.common").common.free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
deadline = time.monotonic() + 5
while len(worker_threads()) < 2 and time.monotonic() < deadline:  # a thread is named once it has started
    time.sleep(0.01)
print(json.dumps({"before": before, "after": worker_threads(), "settled": settle()}))
"""
    report = checked_json(run([PYTHON, "-c", script], clean_env(pythonpath=[PROJECT_DIR])))
    assert report["before"] == {}
    assert len(report["after"]) == 2  # c10d's default: two worker threads per gloo group
    assert report["settled"] is True


def test_activation_registers_the_callback_to_run_after_the_scripts_own_and_revert_removes_it():
    script = """\
import atexit, json, os
import devshim_core.auto
import torch, torch.distributed as dist
from devshim_core.integrations.torch_distributed import clean_exit
from devshim_core.patching import REGISTRY

def reporting_settle(**kwargs):
    print("devshim settles", len(clean_exit.worker_threads()), "workers", flush=True)
    return True

clean_exit.settle = reporting_settle  # the callback looks the function up when it runs
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
dist.barrier()
atexit.register(lambda: print("the script's own exit callback", flush=True))
if os.environ.get("REVERT"):
    REGISTRY.revert("torch.distributed-exit")
"""
    base = clean_env(pythonpath=[PROJECT_DIR], DEVSHIM_PLUGIN="cpu_reference")
    kept = run([PYTHON, "-c", script], {**base, "PORT": str(free_port())})
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.splitlines() == ["the script's own exit callback", "devshim settles 2 workers"]
    reverted = run([PYTHON, "-c", script], {**base, "PORT": str(free_port()), "REVERT": "1"})
    assert reverted.returncode == 0, reverted.stderr
    assert reverted.stdout.splitlines() == ["the script's own exit callback"]


def test_the_exit_patch_is_declared_applied_once_and_reverted():
    registry = PatchRegistry()
    before = atexit._ncallbacks()
    patch_set = clean_exit.patch_set(DEVICE)
    registry.apply(patch_set, DEVICE)
    registry.apply(patch_set, DEVICE)
    assert atexit._ncallbacks() == before + 1
    [row] = registry.report()
    assert (row["set"], row["name"], row["requires"]) == ("torch.distributed-exit", "settle-gloo-workers",
                                                          {"torch": ">=2.4,<3"})
    assert "117762" in row["reason"] or "117762" in patch_set.reason
    assert registry.revert(patch_set.name)  # that the callback then never runs: the subprocess spec above


# What torchrun printed when a peer run (no devshim, so no exit callback) aborted in CI after its report.
PEER_EXIT_ABORT = """\
terminate called without an active exception
W1124 api.py:1028] Sending process 6165 closing signal SIGTERM
E1124 api.py:1002] failed (exitcode: -6) local_rank: 0 (pid: 6164) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 6165)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 6164)  (SIGABRT)
"""


def test_a_peer_job_that_failed_only_by_the_exit_abort_is_recognised():
    assert only_the_upstream_exit_abort(1, PEER_EXIT_ABORT)


def test_any_other_failure_of_a_peer_job_is_not_the_exit_abort():
    assert not only_the_upstream_exit_abort(0, PEER_EXIT_ABORT)  # nothing failed
    assert not only_the_upstream_exit_abort(None, PEER_EXIT_ABORT)  # killed at a timeout
    raised = PEER_EXIT_ABORT.replace("exitcode  : -15 (pid: 6165)  (SIGTERM)", "exitcode  : 1 (pid: 6165)")
    assert not only_the_upstream_exit_abort(1, raised)  # the other rank raised
    no_message = PEER_EXIT_ABORT.replace("terminate called without an active exception\n", "")
    assert not only_the_upstream_exit_abort(1, no_message)  # a SIGABRT of another cause
    only_sigterm = PEER_EXIT_ABORT.replace("exitcode  : -6 (pid: 6164)  (SIGABRT)", "exitcode  : -15 (pid: 6164)")
    assert not only_the_upstream_exit_abort(1, only_sigterm.replace("(exitcode: -6)", "(exitcode: -15)"))
