"""One rank of a 2-rank job on the emulated vendor backend (``hccl`` / ``sccl``), for ``test_collectives.py``.

Started once per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and the ``DEVSHIM_EMULATE`` of
the test process. Like a training script, it runs ``import devshim_core.auto`` (which selects the vendor plugin and
so imports the simulated SDK), then drives ``torch.distributed`` with the plugin's backend on device ``<type>:rank``.
Every check records what it observed (values as lists, dtypes, devices, error messages) under its name, or the error
it raised; the last stdout line is the JSON of all of them. The test compares; this script asserts nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import devshim_core.auto as devshim

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
DEVICE = devshim.device
TYPE = DEVICE.type
HERE = torch.device(TYPE, RANK)
results: dict[str, Any] = {}


def observed(t: torch.Tensor) -> dict[str, Any]:
    return {"values": t.detach().cpu().tolist(), "dtype": str(t.dtype).replace("torch.", ""), "device": str(t.device)}


def check(name: str, run: Callable[[], Any]) -> None:
    try:
        results[name] = run()
    except Exception as exc:  # recorded, not raised: the test says which check broke and how
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def on_device(values: list[Any], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(HERE)


def all_reduce(values: list[Any], op: Any, dtype: torch.dtype = torch.float32,
               group: Any = None) -> dict[str, Any]:
    t = on_device(values, dtype)
    dist.all_reduce(t, op=op, group=group)
    return observed(t)


def broadcast() -> dict[str, Any]:
    t = on_device([float(RANK)] * 4)
    dist.broadcast(t, src=1)
    return observed(t)


def reduce(op: Any) -> dict[str, Any] | None:
    t = on_device([1.0 * (RANK + 1), 10.0 * (RANK + 1)])
    dist.reduce(t, dst=1, op=op)
    return observed(t) if RANK == 1 else None  # only the destination's result is defined


def gather() -> list[dict[str, Any]] | None:
    outputs = [torch.empty(2, device=HERE) for _ in range(WORLD)] if RANK == 0 else None
    dist.gather(on_device([float(RANK), float(RANK) + 0.5]), gather_list=outputs, dst=0)
    return [observed(t) for t in outputs] if outputs is not None else None


def scatter() -> dict[str, Any]:
    output = torch.empty(2, device=HERE)
    chunks = [on_device([float(10 * peer), float(10 * peer + 1)]) for peer in range(WORLD)] if RANK == 1 else None
    dist.scatter(output, scatter_list=chunks, src=1)
    return observed(output)


def all_gather() -> list[dict[str, Any]]:
    outputs = [torch.empty(3, device=HERE) for _ in range(WORLD)]
    dist.all_gather(outputs, on_device([RANK * 10.0, RANK * 10.0 + 1, RANK * 10.0 + 2]))
    return [observed(t) for t in outputs]


def all_gather_into_tensor() -> dict[str, Any]:
    output = torch.empty(WORLD * 3, device=HERE)
    dist.all_gather_into_tensor(output, on_device([RANK * 10.0, RANK * 10.0 + 1, RANK * 10.0 + 2]))
    return observed(output)


def reduce_scatter_tensor(op: Any) -> dict[str, Any]:
    output = torch.empty(2, device=HERE)
    dist.reduce_scatter_tensor(output, on_device([float(i + 100 * RANK) for i in range(2 * WORLD)]), op=op)
    return observed(output)


def reduce_scatter() -> dict[str, Any]:
    output = torch.empty(2, device=HERE)
    inputs = [on_device([float(10 * peer + RANK), float(10 * peer + RANK + 1)]) for peer in range(WORLD)]
    dist.reduce_scatter(output, inputs)
    return observed(output)


def all_to_all_single(uneven: bool) -> dict[str, Any]:
    if not uneven:
        output = torch.empty(4, device=HERE)
        dist.all_to_all_single(output, on_device([float(i + 10 * RANK) for i in range(4)]))
        return observed(output)
    sends = [[1, 2], [2, 1]]  # sends[r][p]: how many elements rank r sends to rank p
    output = torch.empty(3, device=HERE)
    dist.all_to_all_single(output, on_device([float(i + 10 * RANK) for i in range(3)]),
                           output_split_sizes=[sends[p][RANK] for p in range(WORLD)], input_split_sizes=sends[RANK])
    return observed(output)


def all_to_all() -> list[dict[str, Any]]:
    outputs = [torch.empty(2, device=HERE) for _ in range(WORLD)]
    dist.all_to_all(outputs, [on_device([float(10 * RANK + peer)] * 2) for peer in range(WORLD)])
    return [observed(t) for t in outputs]


def send_recv() -> dict[str, Any]:
    if RANK == 0:
        dist.send(on_device([7.0, 8.0, 9.0]), dst=1)
        back = torch.empty(3, device=HERE)
        dist.recv(back, src=1)
        return observed(back)
    got = torch.empty(3, device=HERE)
    dist.recv(got, src=0)
    dist.send(got.flip(0) * 2, dst=0)
    return observed(got)


def recv_from_any_source() -> dict[str, Any]:
    if RANK == 1:
        dist.send(on_device([42.0]), dst=0)
        return {"sent": True}
    got = torch.empty(1, device=HERE)
    source = dist.recv(got)  # src=None: from whichever rank sends
    return {"source": source, **observed(got)}


def isend_irecv() -> dict[str, Any]:
    peer = 1 - RANK
    got = torch.empty(2, device=HERE)
    ops = [dist.P2POp(dist.isend, on_device([float(RANK), float(RANK) + 0.5]), peer),
           dist.P2POp(dist.irecv, got, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return observed(got)


def object_collectives() -> dict[str, Any]:
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, {"rank": RANK, "name": f"rank-{RANK}"})
    sent = [{"from": RANK, "payload": list(range(3))}, "second"]
    dist.broadcast_object_list(sent, src=1)
    return {"all_gather_object": gathered, "broadcast_object_list": sent}


def new_group() -> dict[str, Any]:
    both = dist.new_group([0, 1])
    only_one = dist.new_group([1])  # every rank takes part in creating a group, members or not
    found: dict[str, Any] = {"backend": dist.get_backend(both), "size": dist.get_world_size(both),
                             "sum": all_reduce([float(RANK + 1)], dist.ReduceOp.SUM, group=both)}
    if RANK == 1:
        found["single"] = {"backend": dist.get_backend(only_one), "size": dist.get_world_size(only_one),
                           "sum": all_reduce([5.0], dist.ReduceOp.SUM, group=only_one)}
    return found


def barrier() -> dict[str, Any]:
    dist.barrier()
    return {"passed": True}


def host_tensor_refused() -> dict[str, Any]:
    t = torch.ones(2)
    try:
        dist.all_reduce(t)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "unchanged": t.tolist()}
    return {"accepted": observed(t)}


def main() -> None:
    getattr(torch, TYPE).set_device(RANK)
    sdk = {"npu": "torch_npu", "tpu": "torch_tpu"}[TYPE]
    results["process"] = {"plugin": DEVICE.plugin, "sdk_imported": sdk in sys.modules,
                          "sdk_emulated": bool(getattr(sys.modules.get(sdk), "EMULATED", False))}
    dist.init_process_group(backend=DEVICE.collectives.backend, rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=20))
    results["process"]["backend"] = dist.get_backend()
    sum_, avg, max_ = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX
    mine = [1.0 * (RANK + 1), 2.0 * (RANK + 1), -3.0 * (RANK + 1)]
    check("all_reduce SUM", lambda: all_reduce(mine, sum_))
    check("all_reduce AVG", lambda: all_reduce(mine, avg))
    check("all_reduce MAX", lambda: all_reduce(mine, max_))
    check("all_reduce SUM bfloat16", lambda: all_reduce(mine, sum_, torch.bfloat16))
    check("all_reduce SUM int64", lambda: all_reduce([RANK + 1, 2**20 * (RANK + 1)], sum_, torch.int64))
    check("all_reduce MAX int64", lambda: all_reduce([RANK, -RANK], max_, torch.int64))
    check("all_reduce SUM float64", lambda: all_reduce([0.25 * (RANK + 1), 1e-9], sum_, torch.float64))
    check("all_reduce SUM int32", lambda: all_reduce([RANK + 1, 7], sum_, torch.int32))
    check("all_reduce SUM uint8", lambda: all_reduce([RANK + 1, 100], sum_, torch.uint8))
    check("all_reduce MAX bool", lambda: all_reduce([RANK == 0, False, True], max_, torch.bool))
    check("reduce SUM", lambda: reduce(sum_))
    check("reduce AVG", lambda: reduce(avg))
    check("gather", gather)
    check("scatter", scatter)
    check("broadcast", broadcast)
    check("all_gather", all_gather)
    check("all_gather_into_tensor", all_gather_into_tensor)
    check("reduce_scatter_tensor SUM", lambda: reduce_scatter_tensor(sum_))
    check("reduce_scatter_tensor AVG", lambda: reduce_scatter_tensor(avg))
    check("reduce_scatter", reduce_scatter)
    check("all_to_all_single", lambda: all_to_all_single(uneven=False))
    check("all_to_all_single uneven", lambda: all_to_all_single(uneven=True))
    check("all_to_all", all_to_all)
    check("send/recv", send_recv)
    check("recv from any source", recv_from_any_source)
    check("batch_isend_irecv", isend_irecv)
    check("object collectives", object_collectives)
    check("new_group", new_group)
    check("barrier", barrier)
    check("host tensor", host_tensor_refused)
    print(json.dumps(results), flush=True)  # before the last barrier: a rank left behind cannot hide the rest
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
