"""Spec: a real 2-rank job on the emulated vendor backend (``hccl`` on ascend, ``sccl`` on sophgo) computes every
collective a training framework uses, on tensors of device ``<type>:rank``, with the vendor library's rules.

The job (``collectives_job.py``, one process per rank, inheriting this process's ``DEVSHIM_EMULATE``) runs
``import devshim_core.auto`` as a script would, so the vendor plugin is selected and the simulated SDK is imported
in each rank; it records what every operation produced and the checks below compare it with the arithmetic.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from emulated.conftest import DEVICE_TYPE, VENDOR, only

JOB = Path(__file__).with_name("collectives_job.py")
BACKEND = {"ascend": "hccl", "sophgo": "sccl"}[VENDOR]
SDK = {"ascend": "torch_npu", "sophgo": "torch_tpu"}[VENDOR]
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict[str, Any]]:
    """Both ranks' observations, once per module (the job takes about 10 s, most of it importing torch)."""
    port = str(_free_port())
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, str(JOB)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    observed = {}
    for rank, ((stdout, stderr), proc) in enumerate(zip(outputs, procs, strict=True)):
        lines = stdout.strip().splitlines()
        assert proc.returncode == 0 and lines, (f"rank {rank} exited {proc.returncode}\n{stdout[-3000:]}\n"
                                                f"{stderr[-5000:]}")
        observed[rank] = json.loads(lines[-1])
    return observed


def result(ranks: dict[int, dict[str, Any]], rank: int, name: str) -> Any:
    found = ranks[rank][name]
    if isinstance(found, dict) and "traceback" in found:
        pytest.fail(f"rank {rank}: {name} raised {found['error']}\n{found['traceback']}")
    return found


def on_device(values: list[Any], rank: int, dtype: str = "float32") -> dict[str, Any]:
    """What a tensor of ``values`` on rank ``rank``'s device looks like in the job's records."""
    return {"values": values, "dtype": dtype, "device": f"{DEVICE_TYPE}:{rank}"}


def each_rank(ranks: dict[int, dict[str, Any]], name: str) -> list[Any]:
    return [result(ranks, rank, name) for rank in range(WORLD)]


# -- the job itself --------------------------------------------------------------------------------------------------

def test_every_rank_imported_the_simulated_sdk_and_runs_on_the_vendor_backend(ranks):
    for rank in range(WORLD):
        assert ranks[rank]["process"] == {"plugin": VENDOR, "sdk_imported": True, "sdk_emulated": True,
                                          "backend": BACKEND}, f"rank {rank} ({SDK})"


# -- reductions ------------------------------------------------------------------------------------------------------
# rank r contributes [1, 2, -3] * (r + 1)

@pytest.mark.parametrize(("op", "expected"), [("SUM", [3.0, 6.0, -9.0]), ("AVG", [1.5, 3.0, -4.5]),
                                              ("MAX", [2.0, 4.0, -3.0])])
def test_all_reduce_combines_every_ranks_tensor_in_place(ranks, op, expected):
    assert each_rank(ranks, f"all_reduce {op}") == [on_device(expected, r) for r in range(WORLD)]


def test_all_reduce_in_bfloat16_keeps_the_dtype(ranks):
    assert each_rank(ranks, "all_reduce SUM bfloat16") == [on_device([3.0, 6.0, -9.0], r, "bfloat16")
                                                          for r in range(WORLD)]


@pytest.mark.parametrize(("name", "expected", "dtype"), [
    ("all_reduce SUM int64", [3, 3 * 2**20], "int64"),
    ("all_reduce MAX int64", [1, 0], "int64"),
    ("all_reduce SUM int32", [3, 14], "int32"),
    ("all_reduce SUM uint8", [3, 200], "uint8"),
    ("all_reduce MAX bool", [True, False, True], "bool"),
])
def test_all_reduce_of_integer_and_bool_tensors_is_exact_in_the_callers_dtype(ranks, name, expected, dtype):
    """On sophgo SCCL reduces none of these dtypes but int32: its adaptor narrows to int32 and casts back, so the
    caller still sees its own dtype and the right values (within int32's range)."""
    assert each_rank(ranks, name) == [on_device(expected, r, dtype) for r in range(WORLD)]


@only("sophgo")
def test_on_sophgo_a_float64_all_reduce_is_computed_in_float32_and_handed_back_as_float64(ranks):
    import torch

    narrowed = torch.tensor([0.5, 1e-9], dtype=torch.float32) + torch.tensor([0.25, 1e-9], dtype=torch.float32)
    expected = narrowed.double().tolist()
    assert expected[1] != 2e-9  # the narrowing is visible in the last digits: SCCL has no float64
    assert each_rank(ranks, "all_reduce SUM float64") == [on_device(expected, r, "float64") for r in range(WORLD)]


@only("ascend")
def test_on_ascend_a_float64_all_reduce_is_exact(ranks):
    assert each_rank(ranks, "all_reduce SUM float64") == [on_device([0.75, 2e-9], r, "float64") for r in range(WORLD)]


@pytest.mark.parametrize(("op", "expected"), [("SUM", [3.0, 30.0]), ("AVG", [1.5, 15.0])])
def test_reduce_delivers_the_combination_to_the_destination_rank(ranks, op, expected):
    assert result(ranks, 1, f"reduce {op}") == on_device(expected, 1)


@pytest.mark.parametrize(("op", "expected"), [("SUM", {0: [100.0, 102.0], 1: [104.0, 106.0]}),
                                              ("AVG", {0: [50.0, 51.0], 1: [52.0, 53.0]})])
def test_reduce_scatter_tensor_leaves_each_rank_its_chunk_of_the_reduction(ranks, op, expected):
    # rank r contributes [0, 1, 2, 3] + 100 r; the sums are [100, 102, 104, 106], two per rank
    assert each_rank(ranks, f"reduce_scatter_tensor {op}") == [on_device(expected[r], r) for r in range(WORLD)]


def test_reduce_scatter_of_tensor_lists_sums_each_ranks_inputs_for_it(ranks):
    # rank r's input for peer p is [10 p + r, 10 p + r + 1]
    assert each_rank(ranks, "reduce_scatter") == [on_device([1.0, 3.0], 0), on_device([21.0, 23.0], 1)]


# -- data movement ---------------------------------------------------------------------------------------------------

def test_broadcast_copies_the_source_ranks_tensor_to_every_rank(ranks):
    assert each_rank(ranks, "broadcast") == [on_device([1.0] * 4, r) for r in range(WORLD)]


def test_all_gather_fills_one_tensor_per_rank_in_rank_order(ranks):
    gathered = [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
    for r in range(WORLD):
        assert result(ranks, r, "all_gather") == [on_device(values, r) for values in gathered]


def test_all_gather_into_tensor_concatenates_in_rank_order(ranks):
    assert each_rank(ranks, "all_gather_into_tensor") == [on_device([0.0, 1.0, 2.0, 10.0, 11.0, 12.0], r)
                                                         for r in range(WORLD)]


def test_gather_and_scatter_move_tensors_to_and_from_one_rank(ranks):
    assert result(ranks, 0, "gather") == [on_device([0.0, 0.5], 0), on_device([1.0, 1.5], 0)]
    assert each_rank(ranks, "scatter") == [on_device([0.0, 1.0], 0), on_device([10.0, 11.0], 1)]


def test_all_to_all_single_exchanges_equal_chunks(ranks):
    # rank r sends [0, 1, 2, 3] + 10 r: its first half to rank 0, its second half to rank 1
    assert each_rank(ranks, "all_to_all_single") == [on_device([0.0, 1.0, 10.0, 11.0], 0),
                                                    on_device([2.0, 3.0, 12.0, 13.0], 1)]


def test_all_to_all_single_exchanges_uneven_splits(ranks):
    # rank 0 sends [0] to itself and [1, 2] to rank 1; rank 1 sends [10, 11] to rank 0 and [12] to itself
    assert each_rank(ranks, "all_to_all_single uneven") == [on_device([0.0, 10.0, 11.0], 0),
                                                           on_device([1.0, 2.0, 12.0], 1)]


def test_all_to_all_of_tensor_lists_delivers_each_peers_tensor(ranks):
    for r in range(WORLD):
        assert result(ranks, r, "all_to_all") == [on_device([10.0 * p + r] * 2, r) for p in range(WORLD)]


def test_send_and_recv_carry_a_tensor_between_ranks_both_ways(ranks):
    assert result(ranks, 1, "send/recv") == on_device([7.0, 8.0, 9.0], 1)
    assert result(ranks, 0, "send/recv") == on_device([18.0, 16.0, 14.0], 0)  # what rank 1 sent back: flipped, x2


def test_recv_without_a_source_reports_which_rank_sent(ranks):
    assert result(ranks, 0, "recv from any source") == {"source": 1, **on_device([42.0], 0)}


def test_batch_isend_irecv_completes_when_every_rank_sends_before_it_receives(ranks):
    """Both ranks post an isend then an irecv to each other: point-to-point work must stay pending until waited,
    or each rank blocks in its send and the pair deadlocks."""
    assert each_rank(ranks, "batch_isend_irecv") == [on_device([1.0, 1.5], 0), on_device([0.0, 0.5], 1)]


def test_object_collectives_pickle_through_the_vendor_backend(ranks):
    for r in range(WORLD):
        assert result(ranks, r, "object collectives") == {
            "all_gather_object": [{"rank": 0, "name": "rank-0"}, {"rank": 1, "name": "rank-1"}],
            "broadcast_object_list": [{"from": 1, "payload": [0, 1, 2]}, "second"],
        }


# -- groups, barrier, backend identity -------------------------------------------------------------------------------

def test_new_group_creates_groups_of_the_vendor_backend(ranks):
    for r in range(WORLD):
        found = result(ranks, r, "new_group")
        assert {k: found[k] for k in ("backend", "size", "sum")} == {"backend": BACKEND, "size": 2,
                                                                     "sum": on_device([3.0], r)}
    assert result(ranks, 1, "new_group")["single"] == {"backend": BACKEND, "size": 1, "sum": on_device([5.0], 1)}
    assert "single" not in result(ranks, 0, "new_group")  # rank 0 is not a member of [1]


def test_barrier_returns_on_every_rank(ranks):
    assert each_rank(ranks, "barrier") == [{"passed": True}] * WORLD


def test_a_host_tensor_is_refused_as_the_vendor_library_refuses_it(ranks):
    message = (f"RuntimeError: {BACKEND.upper()} allreduce: tensors must be on the {DEVICE_TYPE} device, got a "
               f"tensor on cpu (move it with .to('{DEVICE_TYPE}') first")
    for r in range(WORLD):
        refused = result(ranks, r, "host tensor")
        assert "error" in refused, f"rank {r}: {BACKEND} reduced a CPU tensor: {refused}"
        assert refused["error"].startswith(message)
        assert refused["unchanged"] == [1.0, 1.0]
