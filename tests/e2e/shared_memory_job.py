"""Each rank checks devshim's shared-memory collectives against gloo's own (``test_shared_memory_collectives``).

Usage: torchrun --nproc-per-node N shared_memory_job.py --report PATH. Rank 0 writes the report: for each case,
whether the shared-memory path served it (a spy on ``Segment``) and how its result compares with gloo's.
"""

import devshim_core.auto  # noqa: F401, I001 - first, as in a user's script

import argparse
import json
import os
import resource
import signal
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from devshim_core.integrations.torch_distributed import shared_memory, shm_segment

SERVED: list[str] = []


def spy() -> None:
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        method = getattr(shm_segment.Segment, name)

        def counted(self: Any, *args: Any, _method: Callable[..., Any] = method, _name: str = name) -> Any:
            SERVED.append(_name)
            return _method(self, *args)

        setattr(shm_segment.Segment, name, counted)


def gloo(function: Callable[..., Any]) -> Callable[..., Any]:
    """torch's own function under devshim's wrappers."""
    while hasattr(function, "__devshim_original__"):
        function = function.__devshim_original__
    return function


def served_by_shared_memory(call: Callable[[], Any]) -> bool:
    before = len(SERVED)
    call()
    return len(SERVED) > before


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    exact = torch.equal(a, b)
    difference = 0.0 if exact else (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item() or 1.0
    return {"equal": exact, "relative": difference / scale}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    spy()
    all_reduce, all_gather, reduce_scatter = (gloo(dist.all_reduce), gloo(dist.all_gather_into_tensor),
                                              gloo(dist.reduce_scatter_tensor))
    report: dict[str, Any] = {"ranks": size, "cases": {}}
    generator = torch.Generator().manual_seed(1234 + rank)
    slot = shm_segment.SLOT_BYTES

    # sizes: one chunk, an odd size over several chunks (each element size), and per-rank shares that do not split
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for numel in (4097, slot // 2 + 7 * size + 1):
            source = (torch.randn(numel, generator=generator) * 64).to(dtype)
            ours, theirs = source.clone(), source.clone()
            served = served_by_shared_memory(lambda: dist.all_reduce(ours))  # noqa: B023
            all_reduce(theirs)
            width = source.element_size()
            report["cases"][f"all_reduce {dtype} {numel}"] = {"served": served, "bytes": numel * width,
                                                              **compare(ours, theirs)}

            gathered, expected = torch.empty(numel * size, dtype=dtype), torch.empty(numel * size, dtype=dtype)
            served = served_by_shared_memory(lambda: dist.all_gather_into_tensor(gathered, source))  # noqa: B023
            all_gather(expected, source)
            report["cases"][f"all_gather_into_tensor {dtype} {numel}"] = {
                "served": served, "bytes": numel * width, **compare(gathered, expected)}

            whole = source[:numel // size * size]
            scattered, expected = torch.empty(numel // size, dtype=dtype), torch.empty(numel // size, dtype=dtype)
            served = served_by_shared_memory(lambda: dist.reduce_scatter_tensor(scattered, whole))  # noqa: B023
            reduce_scatter(expected, whole)
            report["cases"][f"reduce_scatter_tensor {dtype} {numel}"] = {
                "served": served, "bytes": numel // size * width, **compare(scattered, expected)}

    # what keeps gloo: the result is gloo's, and the shared-memory path is not taken
    big = torch.randn(1 << 20, generator=generator)
    # each call made once through devshim's all_reduce and once through gloo's
    fallbacks: dict[str, Callable[[Callable[..., Any], torch.Tensor], Any]] = {
        "non-contiguous": lambda reduce, t: reduce(t[::2]),
        "async_op": lambda reduce, t: reduce(t, async_op=True).wait(),
        "MAX": lambda reduce, t: reduce(t, op=dist.ReduceOp.MAX),
    }
    for name, call in fallbacks.items():
        ours, theirs = big.clone(), big.clone()
        served = served_by_shared_memory(lambda: call(dist.all_reduce, ours))  # noqa: B023
        call(all_reduce, theirs)
        report["cases"][f"keeps gloo: {name}"] = {"served": served, **compare(ours, theirs)}

    # autograd does not see the write, as with gloo
    tracked = big.clone().requires_grad_(True) * 1.0
    version = tracked._version
    dist.all_reduce(tracked)
    report["version_counter_unchanged"] = tracked._version == version

    # a subgroup of two ranks (of three), and the ranks outside it
    if size >= 3:
        pair = dist.new_group([0, 2])
        if rank in (0, 2):
            ours, theirs = big.clone(), big.clone()
            served = served_by_shared_memory(lambda: dist.all_reduce(ours, group=pair))
            all_reduce(theirs, group=pair)
            report["cases"]["subgroup of ranks 0 and 2"] = {"served": served, "bytes": big.numel() * 4,
                                                            **compare(ours, theirs)}

    # ranks that report different hosts keep gloo
    real_host = shm_segment.host_identity
    shm_segment.host_identity = lambda: (f"host-{rank}", "boot")
    other_hosts = dist.new_group(list(range(size)))
    ours, theirs = big.clone(), big.clone()
    served = served_by_shared_memory(lambda: dist.all_reduce(ours, group=other_hosts))
    all_reduce(theirs)
    report["cases"]["keeps gloo: ranks on different hosts"] = {"served": served, **compare(ours, theirs)}
    shm_segment.host_identity = real_host

    # rank 0 cannot reserve the segment (a file-size limit stands in for a full /dev/shm): every rank keeps gloo
    if rank == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
    cannot_reserve = dist.new_group(list(range(size)))
    ours, theirs = big.clone(), big.clone()
    served = served_by_shared_memory(lambda: dist.all_reduce(ours, group=cannot_reserve))
    all_reduce(theirs)
    report["cases"]["keeps gloo: the segment cannot be reserved"] = {"served": served, **compare(ours, theirs)}
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)

    dist.barrier()
    mine = f"{shm_segment.FILE_PREFIX}-{socket.gethostname()}-{os.getpid()}-"
    report["left_in_dev_shm"] = sorted(name for name in os.listdir(shm_segment.SHM_DIRECTORY) if name.startswith(mine))
    report["thresholds"] = shared_memory.THRESHOLD_BYTES
    reports: list[Any] = [None] * size
    dist.all_gather_object(reports, report)
    if rank == 0:
        with open(args.report, "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
