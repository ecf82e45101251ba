"""Spec: a collective the ranks disagree on, a rank that dies or never comes, threads and group churn: every rank
fails within seconds naming the rank and what differs, or the call completes; never wrong data, never a hang.

Each test starts two ranks of ``collective_fault_job.py`` itself (no launcher, which would kill the survivor
before it speaks) on the ``cpu_reference`` plugin, where CPU collectives go through devshim's shared memory, and
reads each rank's ``RESULT`` line. gloo alone returns wrong data for the first case (an all-reduce of 1024
elements against one of 2048) and hangs for the second (16 against 2**20 elements) until its timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from devshim_core.integrations.torch_distributed import shm_segment
from devshim_core.testing.launch import free_port

JOB = Path(__file__).resolve().parent / "collective_fault_job.py"
SECONDS = 20  # what "within seconds" means here, on a loaded 2-core machine (a call itself takes milliseconds)

pytestmark = pytest.mark.skipif(not shm_segment.NATIVE, reason="devshim_core's _shm_sync did not build: the "
                                "collectives stay gloo's (DEVSHIM_REQUIRE_NATIVE=1 makes this an error in CI)")


def run_ranks(case: str, per_rank: dict[int, dict[str, str]] | None = None, pg_timeout: float = 60,
              timeout_s: float = 120) -> list[dict[str, Any]]:
    """Both ranks' RESULT dicts (``returncode`` and ``stderr`` added; no RESULT for a rank that died)."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_")}
    base.update(DEVSHIM_PLUGIN="cpu_reference", DEVSHIM_CPU_DEVICE_COUNT="2", OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                FAULT_PG_TIMEOUT=str(pg_timeout))
    procs = []
    for rank in (0, 1):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), **(per_rank or {}).get(rank, {})}
        procs.append(subprocess.Popen([sys.executable, str(JOB), case], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{case}: a rank hung past {timeout_s} s")
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][len("RESULT "):]) if lines else {}
        results.append({**result, "returncode": proc.returncode, "stderr": err[-3000:]})
    return results


@pytest.mark.parametrize("case, differs", [
    ("sizes", "rank 0: all_reduce of 1024 elements of torch.float32, op SUM, call #1; rank 1: all_reduce of 2048"),
    ("small_and_large", "rank 0: all_reduce of 16 elements of torch.float32, op SUM, call #1; rank 1: all_reduce of "
                        "1048576 elements"),
    ("ops", "rank 0: all_reduce of 4096 elements of torch.float32, op SUM, call #1; rank 1: all_reduce of 4096 "
            "elements of torch.float32, op MAX"),
    ("dtypes", "rank 1: all_reduce of 4096 elements of torch.bfloat16"),
    ("gather_sizes", "rank 0: all_gather_into_tensor of 1000 elements of torch.float32 (2000 in the whole, 2 ranks x "
                     "1000 expected), call #1; rank 1: all_gather_into_tensor of 1001 elements"),
])
def test_ranks_that_disagree_on_a_collective_both_fail_at_once_naming_each_call(case, differs):
    """Fault: the ranks pass different sizes, ops or dtypes. User sees, on every rank and within seconds, a
    CollectiveMismatchError listing each rank's call; no rank's tensor was changed."""
    for result in run_ranks(case):
        call = result["call"]
        assert not call["ok"] and call["type"] == "CollectiveMismatchError", result
        assert differs in call["message"], call["message"]
        assert "differs from rank 0" in call["message"]
        assert call["seconds"] < SECONDS
        assert result["unchanged"], result


def test_a_tensor_non_contiguous_on_one_rank_only_gets_glooss_result_on_both():
    """Fault: one rank passes a transposed view. Every rank takes gloo's path together (no rank waits alone in
    shared memory), and the result is the one gloo gives without devshim."""
    for result in run_ranks("non_contiguous_on_one_rank"):
        assert result["call"]["ok"] and result["equal_to_gloo"], result


def test_two_threads_on_two_groups_in_opposite_order_do_not_deadlock():
    """Fault: each rank's two threads make their first call on two groups, in opposite orders. Both finish with the
    right sums (one lock per group, none held across another group's set-up)."""
    for result in run_ranks("threads"):
        assert result["call"]["ok"], result
        assert result["sums"] == [3.0, 3.0]


def test_destroy_process_group_unmaps_the_groups_segment():
    """Fault: 20 cycles of new_group, a collective, destroy_process_group(group). No segment stays mapped."""
    for result in run_ranks("group_cycles"):
        assert result["call"]["ok"], result
        assert result["mapped_segments"] == 0 and result["mappings"] == 0, result


def test_a_rank_killed_between_collectives_is_named_by_the_survivor_within_seconds():
    """Fault: rank 1 gets SIGKILL while rank 0 is inside an all-reduce. Rank 0 raises naming rank 1 and its
    process within seconds (not at the process group's timeout), its segment is unmapped, a later call on the group
    raises the same failure at once, and nothing is left in /dev/shm."""
    rank0, rank1 = run_ranks("killed")
    assert rank1["returncode"] == -signal.SIGKILL
    call = rank0["call"]
    assert not call["ok"] and call["type"] == "CollectiveError", rank0
    assert "rank 1 of this 2-rank group exited" in call["message"], call["message"]
    assert call["seconds"] < SECONDS
    assert rank0["mappings_after"] == 0
    again = rank0["again"]
    assert not again["ok"] and again["message"].startswith("devshim's shared-memory collectives stopped on this group "
                                                           "after: ") and again["seconds"] < 1, again
    pids = {str(rank0["pid"]), str(os.getpid())}  # rank 1 printed nothing; rank 0 created the segment
    assert not [name for name in os.listdir(shm_segment.SHM_DIRECTORY)
                if name.startswith(shm_segment.FILE_PREFIX) and name.split("-")[-2] in pids]


def test_a_rank_that_never_makes_the_call_is_named_at_the_groups_timeout():
    """Fault: rank 1 is alive but takes another branch. Rank 0 raises after the process group's timeout (3 s
    here), naming rank 1, instead of blaming no one."""
    rank0, _ = run_ranks("missing", pg_timeout=3)
    call = rank0["call"]
    assert not call["ok"], rank0
    assert "timed out after 3 s: rank 1 of this 2-rank group did not reach it" in call["message"], call["message"]
    assert 3 <= call["seconds"] < 3 + SECONDS


def test_the_collectives_switch_set_on_one_rank_only_stops_init_naming_the_rank():
    """Fault: DEVSHIM_SHARED_MEMORY_COLLECTIVES=0 on rank 1 only. Rank 1's init_process_group raises naming the
    switch and both values, instead of both ranks waiting on different transports."""
    _, rank1 = run_ranks("agreement", per_rank={1: {"DEVSHIM_SHARED_MEMORY_COLLECTIVES": "0"}})
    init = rank1["init"]
    assert init["type"] == "PluginMismatchError", rank1
    assert ("rank 1 has DEVSHIM_SHARED_MEMORY_COLLECTIVES=0, but rank 0 has 1 (the default): the ranks would wait "
            "for each other on different transports") in init["message"]


@pytest.mark.parametrize("without", [0, 1], ids=["rank 0 without devshim", "rank 1 without devshim"])
def test_a_rank_without_devshim_is_named_within_the_groups_timeout_not_the_stores(without):
    """Fault: one rank runs without devshim. The other raises within the group's timeout (5 s here; 30 s at most)
    saying which rank lacks devshim, where it used to block until the store's timeout with a bare
    DistStoreError."""
    results = run_ranks("agreement", per_rank={without: {"FAULT_NO_DEVSHIM": "1"}}, pg_timeout=5)
    other = results[1 - without]
    init = other["init"]
    assert init["type"] == "PluginMismatchError", other
    expected = ("rank 1 waited 5 s after init_process_group for rank 0's devshim selection, which never came: rank 0 "
                "runs without devshim" if without == 0 else
                "rank 1 did not report devshim's selection to rank 0 within 5 s of init_process_group: such a rank "
                "runs without devshim")
    assert expected in init["message"], init["message"]
    assert init["seconds"] < 5 + SECONDS


def test_a_segment_a_killed_process_left_in_dev_shm_is_swept(tmp_path):
    """Fault: a rank was killed between creating its group's segment and unlinking it. The next segment created on
    this host removes the file (its creator no longer runs); files of live processes and of other hosts stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    left = tmp_path / f"{shm_segment.FILE_PREFIX}-{host}-{dead.pid}-0123456789abcdef"
    live = tmp_path / f"{shm_segment.FILE_PREFIX}-{host}-{os.getpid()}-0123456789abcdef"
    other_host = tmp_path / f"{shm_segment.FILE_PREFIX}-elsewhere-{dead.pid}-0123456789abcdef"
    for path in (left, live, other_host):
        path.write_bytes(b"x")
    segments = shm_segment.Segments(str(tmp_path))
    created = segments._create(1 << 16)
    assert created is not None
    os.unlink(created)
    assert not left.exists() and live.exists() and other_host.exists()
