"""Large collectives between ranks of one host go through shared memory instead of gloo's TCP loopback.

gloo moves every byte of a CPU collective through a socket, even when all ranks share one machine: a 100 MB
bf16 gradient all-reduce between two local ranks spends most of a ZeRO-Offload step in the kernel's TCP stack.
For the three collectives that carry a training job's bulk data (``all_reduce`` with ``SUM``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``), this set copies each rank's tensor into a shared segment,
synchronises with the group's own ``barrier``, and lets each rank reduce or gather from the others' slots.

When it applies, decided the same way on every rank (so no rank takes a path the others do not):

- the group's backend is gloo, it has more than one rank, and every rank is on this host (same host name and
  boot id, checked once per group);
- the call is blocking, with dense contiguous CPU tensors of one supported dtype, the sizes a collective
  needs, ``SUM`` for the reductions, and at least ``MIN_BYTES`` per rank (below that gloo's latency can win);
- the group's segment could be created: a file in ``/dev/shm``, mode 0600, its space reserved with
  ``posix_fallocate`` (so a small ``/dev/shm`` is a clean refusal, not a SIGBUS) and unlinked once every rank
  mapped it, so nothing is left behind by a crash. If any rank could not map it, the group keeps gloo.

Everything else is gloo's call, unchanged. Sums run in rank order, in the tensor's dtype: with two ranks the
result equals gloo's bit for bit (addition commutes); with more, floating-point results can differ from gloo's
ring order in the last bits, as they would between two gloo versions. Writes go through ``Tensor.data``, so,
as with gloo, autograd's version counters do not move.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.integrations.torch_distributed import TORCH, in_both_modules
from devshim_core.patching import PatchSet

MIN_BYTES = 1 << 20  # per rank; set conservatively: no bench row measures the crossover with gloo yet
SLOT_BYTES = 16 << 20  # per rank and generation: a 2-rank group maps 64 MiB
SHM_DIRECTORY = "/dev/shm"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _host() -> tuple[str, str]:
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:  # no procfs: the host name alone must match
        boot = ""
    return socket.gethostname(), boot


class Segment:
    """A group's shared slots: two generations of ``size`` slots of ``SLOT_BYTES``, used alternately.

    A rank writes a generation only after the barrier of the previous use of the other one, which every rank
    reaches after it finished reading this one: no trailing barrier is needed.
    """

    def __init__(self, data: Any, group: Any, rank: int, size: int, barrier: Callable[..., Any]) -> None:
        self.data, self.group, self.rank, self.size = data, group, rank, size
        self._barrier = barrier
        self._generation = 0

    def barrier(self) -> None:
        self._barrier(group=self.group)

    def slots(self, dtype: Any) -> Any:
        """The next generation's slots as a ``(size, SLOT_BYTES // itemsize)`` tensor of ``dtype``."""
        span = self.size * SLOT_BYTES
        start = self._generation * span
        self._generation ^= 1
        return self.data[start:start + span].view(dtype).view(self.size, -1)

    def all_reduce(self, flat: Any) -> None:
        per = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per):
            piece = flat[start:start + per]
            length = piece.numel()
            slots = self.slots(flat.dtype)
            slots[self.rank, :length].copy_(piece)
            self.barrier()
            low, high = length * self.rank // self.size, length * (self.rank + 1) // self.size
            if high > low:  # this rank's share, summed into slot 0 in rank order
                total = slots[0, low:high]
                for k in range(1, self.size):
                    total.add_(slots[k, low:high])
            self.barrier()
            piece.copy_(slots[0, :length])

    def all_gather(self, output: Any, flat: Any) -> None:
        count = flat.numel()
        per = SLOT_BYTES // flat.element_size()
        gathered = output.view(self.size, count)
        for start in range(0, count, per):
            length = min(per, count - start)
            slots = self.slots(flat.dtype)
            slots[self.rank, :length].copy_(flat[start:start + length])
            self.barrier()
            gathered[:, start:start + length].copy_(slots[:, :length])

    def reduce_scatter(self, output: Any, flat: Any) -> None:
        count = output.numel()
        per = SLOT_BYTES // flat.element_size() // self.size
        parts = flat.view(self.size, count)
        for start in range(0, count, per):
            length = min(per, count - start)
            slots = self.slots(flat.dtype)
            slots[self.rank, :self.size * length].view(self.size, length).copy_(parts[:, start:start + length])
            self.barrier()
            mine = slice(self.rank * length, (self.rank + 1) * length)
            total = output[start:start + length]
            total.copy_(slots[0, mine])
            for k in range(1, self.size):
                total.add_(slots[k, mine])


class Segments:
    """Each group's segment, or ``None`` where the group keeps gloo; set up collectively on first use."""

    def __init__(self, directory: str = SHM_DIRECTORY) -> None:
        self.directory = directory
        self._by_group: dict[int, tuple[Any, Segment | None]] = {}  # id(group) -> (group kept alive, segment)
        self._lock = threading.Lock()

    def of(self, group: Any) -> Segment | None:
        import torch.distributed as dist

        if group is None:
            group = dist.distributed_c10d._get_default_group()
        found = self._by_group.get(id(group))
        if found is None:
            with self._lock:
                found = self._by_group.get(id(group))
                if found is None:
                    found = self._by_group[id(group)] = (group, self._set_up(group))
        return found[1]

    def _set_up(self, group: Any) -> Segment | None:
        import torch
        import torch.distributed as dist

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size < 2 or dist.get_backend(group) != "gloo":
            return None
        hosts: list[Any] = [None] * size
        dist.all_gather_object(hosts, _host(), group=group)
        if len(set(hosts)) != 1:
            return None
        total = 2 * size * SLOT_BYTES
        path = [self._create(total) if rank == 0 else None]
        dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
        data = None
        if path[0] is not None:
            with contextlib.suppress(OSError, RuntimeError):
                data = torch.from_file(path[0], shared=True, size=total, dtype=torch.uint8)
        mapped: list[Any] = [None] * size
        dist.all_gather_object(mapped, data is not None, group=group)  # every rank mapped it, or none uses it
        if rank == 0 and path[0] is not None:
            with contextlib.suppress(OSError):
                os.unlink(path[0])
        if not all(mapped):
            return None
        return Segment(data, group, rank, size, dist.barrier)

    def _create(self, total: int) -> str | None:
        path = os.path.join(self.directory, f"devshim-collectives-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, total)  # reserve now: a full tmpfs refuses here instead of a SIGBUS later
        except OSError:
            os.close(fd)
            os.unlink(path)
            return None
        os.close(fd)
        return path


SEGMENTS = Segments()


@functools.cache
def _dtypes() -> frozenset[Any]:
    import torch

    return frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                      torch.int16, torch.int32, torch.int64))


_NOT_A_REDUCTION = object()


def _segment_for(group: Any, async_op: bool, part: Any, whole: Any = None,
                 op: Any = _NOT_A_REDUCTION) -> Segment | None:
    """The group's segment when this call is served (the rules in the module docstring), else ``None``.

    ``part`` holds one rank's share; ``whole``, for a gather or scatter, holds every rank's. Every test but the
    segment's own set-up is local, and gives the same answer on every rank of a well-formed collective.
    """
    import torch
    import torch.distributed as dist

    if async_op or part.numel() * part.element_size() < MIN_BYTES:
        return None
    if op is not _NOT_A_REDUCTION and op != dist.ReduceOp.SUM:
        return None
    tensors = (part,) if whole is None else (part, whole)
    if part.dtype not in _dtypes() or not all(t.device.type == "cpu" and t.layout == torch.strided
                                              and t.is_contiguous() and t.dtype == part.dtype for t in tensors):
        return None
    if dist.distributed_c10d._rank_not_in_group(group):
        return None
    if whole is not None and whole.numel() != part.numel() * dist.get_world_size(group):
        return None  # sizes a collective cannot take: gloo's own call says what is wrong
    return SEGMENTS.of(group)


def _all_reduce(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    import torch.distributed as dist

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        segment = _segment_for(group, async_op, tensor, op=op)
        if segment is not None:
            segment.all_reduce(tensor.data.view(-1))
            return None
        return original(tensor, op=op, group=group, async_op=async_op)

    all_reduce.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return all_reduce


def _all_gather_into_tensor(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None,
                               async_op: bool = False) -> Any:
        segment = _segment_for(group, async_op, input_tensor, whole=output_tensor)
        if segment is not None:
            segment.all_gather(output_tensor.data.view(-1), input_tensor.data.view(-1))
            return None
        return original(output_tensor, input_tensor, group=group, async_op=async_op)

    all_gather_into_tensor.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return all_gather_into_tensor


def _reduce_scatter_tensor(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    import torch.distributed as dist

    def reduce_scatter_tensor(output: Any, input: Any, op: Any = dist.ReduceOp.SUM, group: Any = None,
                              async_op: bool = False) -> Any:
        segment = _segment_for(group, async_op, output, whole=input, op=op)
        if segment is not None:
            segment.reduce_scatter(output.data.view(-1), input.data.view(-1))
            return None
        return original(output, input, op=op, group=group, async_op=async_op)

    reduce_scatter_tensor.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return reduce_scatter_tensor


def patch_set(device: Device) -> PatchSet:
    return PatchSet(
        name="torch.distributed-shared-memory",
        requires=(TORCH,),
        reason="large CPU collectives between ranks of one host copy through shared memory, not gloo's TCP "
               "loopback",
        patches=(
            *in_both_modules("shared-memory-all-reduce", "all_reduce", _all_reduce,
                             "a SUM all-reduce of >= 1 MiB per rank on one host: one copy in, a share summed, one "
                             "copy out"),
            *in_both_modules("shared-memory-all-gather", "all_gather_into_tensor", _all_gather_into_tensor,
                             "an all-gather of >= 1 MiB per rank on one host: one copy in, one copy out"),
            *in_both_modules("shared-memory-reduce-scatter", "reduce_scatter_tensor", _reduce_scatter_tensor,
                             "a SUM reduce-scatter of >= 1 MiB per rank on one host"),
        ),
    )
