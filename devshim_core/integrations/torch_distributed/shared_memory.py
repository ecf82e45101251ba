"""Collectives between ranks of one host go through shared memory instead of gloo's TCP loopback.

gloo moves every byte of a CPU collective through a socket, even when all ranks share one machine: a 100 MB
bf16 gradient all-reduce between two local ranks spends most of a ZeRO-Offload step in the kernel's TCP stack.
For the three collectives that carry a training job's bulk data (``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``), this set copies each rank's tensor into the group's shared segment, meets the other
ranks at a barrier of shared counters, and lets each rank reduce or gather from the others' slots
(``shm_segment`` has the layout and the protocol).

**The ranks decide together.** Every blocking call of the three on a served group first exchanges a header (the
collective, the op, the dtype, the element counts, the call's number, and whether this rank's tensors can take
the shared path). With the headers compared, every rank makes the same choice: the shared path when all can take
it and the size is at least the measured crossover with gloo (``THRESHOLD_BYTES``); gloo's own call for all of
them otherwise; and when the headers differ, :class:`~devshim_core.errors.CollectiveMismatchError` on every rank
at once, naming each rank's call, where gloo would fail ("doesn't match expected size"), hang, or (with different ops)
return a wrong sum. A rank that dies or never comes is named after at most the group's timeout (within half a
second when its process is gone).

A group is served when its backend is gloo, it has more than one rank, every rank is on this host (same host name
and boot id) and has the native barrier (``_shm_sync``, built at install), and its segment could be created: a
file in ``/dev/shm``, mode 0600, its space reserved with ``posix_fallocate`` (so a full ``/dev/shm`` is a clean
refusal, not a SIGBUS) and unlinked once every rank mapped it, or on any error before, so a crash leaves nothing;
files that killed processes left behind are swept when the next segment is created. If any rank could not map
it, the group keeps gloo. A segment is unmapped by ``destroy_process_group``.

A call takes the shared path when it is blocking, with dense contiguous CPU tensors of one supported dtype, the
sizes a collective needs and ``SUM`` for the reductions. ``async_op=True`` calls go to gloo without the exchange:
a rank that makes a call async while the others do not is reported missing by them after the timeout. Sums run
in rank order, in the tensor's dtype: with two ranks the result equals gloo's bit for bit (addition commutes);
with more, floating-point results can differ from gloo's ring order in the last bits, as they would between two
gloo versions. Writes go through ``Tensor.data``, so, as with gloo, autograd's version counters do not move.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.errors import CollectiveError, CollectiveMismatchError
from devshim_core.integrations.torch_distributed import TORCH, in_both_modules
from devshim_core.integrations.torch_distributed.shm_segment import KINDS, SEGMENTS, Header
from devshim_core.patching import PatchSet

# the smallest call, in bytes per rank, that takes the shared path: where `python -m bench --only collectives`
# measured it faster than gloo. On 2026-11-26 (docs/performance.md) every size from 256 B, the smallest measured,
# was met at 0.04-0.42x gloo's time, fp32 and bf16, for all three: no size is left to gloo
THRESHOLD_BYTES = {"all_reduce": 0, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}


@functools.cache
def _dtypes() -> tuple[Any, ...]:
    import torch

    return (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
            torch.int32, torch.int64)


def dtype_code(dtype: Any) -> int:
    """A number every rank computes alike: the index of a served dtype, else one derived from its name."""
    served = _dtypes()
    return served.index(dtype) if dtype in served else 1000 + zlib.crc32(str(dtype).encode()) % 1_000_000


def _op_code(op: Any) -> int:
    inner = getattr(op, "op", op)  # a ReduceOp instance wraps its RedOpType
    try:
        return int(inner)
    except (TypeError, ValueError):
        return 99


def _describe(header: Header, size: int) -> str:
    import torch.distributed as dist

    kind = KINDS[header.kind] if 0 <= header.kind < len(KINDS) else f"collective #{header.kind}"
    dtype = str(_dtypes()[header.dtype]) if 0 <= header.dtype < len(_dtypes()) else f"dtype #{header.dtype}"
    text = f"{kind} of {header.count} elements of {dtype}"
    if header.whole >= 0:
        text += f" ({header.whole} in the whole, {size} ranks x {header.count} expected)"
    if header.op >= 0:
        names = {v.value: k for k, v in dist.ReduceOp.RedOpType.__members__.items()}
        text += f", op {names.get(header.op, header.op)}"
    return f"{text}, call #{header.seq}"


def _mismatch(headers: list[Header], rank: int, size: int) -> CollectiveMismatchError:
    mine = headers[rank].agreed()
    lines = "; ".join(f"rank {k}: {_describe(h, size)}" for k, h in enumerate(headers))
    differ = [k for k, h in enumerate(headers) if h.agreed() != headers[0].agreed()]
    return CollectiveMismatchError(
        f"torch.distributed.{KINDS[headers[rank].kind] if mine[1] < len(KINDS) else 'collective'}: the ranks of "
        f"this {size}-rank group made different calls ({lines}); rank {differ[0]} differs from rank 0. Every rank "
        "must pass tensors of the same size and dtype and the same op, in the same order (gloo fails such a call "
        "with \"doesn't match expected size\", or sums what it was given). No rank's tensor was changed.")


def _eligible(kind: str, part: Any, whole: Any, op: Any, size: int) -> bool:
    """The local rules of the shared path (module docstring); every rank of a well-formed call agrees."""
    import torch
    import torch.distributed as dist

    if op is not None and op != dist.ReduceOp.SUM:
        return False
    tensors = (part,) if whole is None else (part, whole)
    if part.dtype not in _dtypes() or part.numel() == 0:
        return False
    if not all(t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
               and t.dtype == part.dtype for t in tensors):
        return False
    return whole is None or whole.numel() == part.numel() * size


def _call(kind: str, group: Any, async_op: bool, part: Any, whole: Any, op: Any,
          shared: Callable[[Any, int, str], None], gloo: Callable[[], Any]) -> Any:
    """Serve one call: the header exchange, then the path every rank chose (module docstring)."""
    import torch
    import torch.distributed as dist

    if async_op or not isinstance(part, torch.Tensor) or (whole is not None and not isinstance(whole, torch.Tensor)):
        return gloo()
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if SEGMENTS.keeps_gloo(group) or dist.distributed_c10d._rank_not_in_group(group):
        return gloo()
    with SEGMENTS.of(group) as segment:
        if segment is None:
            return gloo()
        if segment.failure is not None:
            raise CollectiveError(f"devshim's shared-memory collectives stopped on this group after: "
                                  f"{segment.failure}")
        segment.calls += 1
        what = f"torch.distributed.{kind} (call #{segment.calls} on this group, rank {segment.rank})"
        eligible = _eligible(kind, part, whole, op, segment.size)
        header = Header(seq=segment.calls, kind=KINDS.index(kind), op=-1 if op is None else _op_code(op),
                        dtype=dtype_code(part.dtype), count=part.numel(),
                        whole=-1 if whole is None else whole.numel(), eligible=int(eligible))
        take_shared = eligible and part.numel() * part.element_size() >= THRESHOLD_BYTES[kind]
        generation = segment.begin_round()
        if take_shared:
            _first_piece(kind, segment, generation, part, whole)
        segment.write_header(generation, header)
        segment.barrier(what)
        headers = segment.read_headers(generation)
        if any(h.agreed() != header.agreed() for h in headers):
            raise _mismatch(headers, segment.rank, segment.size)
        if take_shared and all(h.eligible for h in headers):
            shared(segment, generation, what)
            return None
        return gloo()


def _first_piece(kind: str, segment: Any, generation: int, part: Any, whole: Any) -> None:
    """Write the call's first piece with its header, so that one barrier serves both."""
    from devshim_core.integrations.torch_distributed.shm_segment import SLOT_BYTES

    if kind == "reduce_scatter_tensor":
        count = part.numel()
        length = min(segment.per_rank_piece(whole.element_size()), count)
        segment.write_reduce_scatter_piece(generation, whole.data.view(segment.size, count), 0, length)
        return
    flat = part.data.view(-1)
    length = min(SLOT_BYTES // flat.element_size(), flat.numel())
    segment.slots(generation, flat.dtype)[segment.rank, :length].copy_(flat[:length])


def _all_reduce(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    import torch.distributed as dist

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        return _call("all_reduce", group, async_op, tensor, None, op,
                     lambda segment, generation, what: segment.all_reduce(tensor.data.view(-1), generation, what),
                     lambda: original(tensor, op=op, group=group, async_op=async_op))

    all_reduce.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return all_reduce


def _all_gather_into_tensor(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None,
                               async_op: bool = False) -> Any:
        return _call("all_gather_into_tensor", group, async_op, input_tensor, output_tensor, None,
                     lambda segment, generation, what: segment.all_gather(
                         output_tensor.data.view(-1), input_tensor.data.view(-1), generation, what),
                     lambda: original(output_tensor, input_tensor, group=group, async_op=async_op))

    all_gather_into_tensor.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return all_gather_into_tensor


def _reduce_scatter_tensor(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    import torch.distributed as dist

    def reduce_scatter_tensor(output: Any, input: Any, op: Any = dist.ReduceOp.SUM, group: Any = None,
                              async_op: bool = False) -> Any:
        return _call("reduce_scatter_tensor", group, async_op, output, input, op,
                     lambda segment, generation, what: segment.reduce_scatter(
                         output.data.view(-1), input.data.view(-1), generation, what),
                     lambda: original(output, input, op=op, group=group, async_op=async_op))

    reduce_scatter_tensor.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return reduce_scatter_tensor


def _destroy_process_group(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        try:
            return original(group)
        finally:
            SEGMENTS.release(group)

    destroy_process_group.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return destroy_process_group


def patch_set(device: Device) -> PatchSet:
    return PatchSet(
        name="torch.distributed-shared-memory",
        requires=(TORCH,),
        reason="CPU collectives between ranks of one host copy through shared memory, not gloo's TCP loopback; the "
               "ranks compare their calls first, so a mismatch fails on every rank instead of returning wrong data",
        patches=(
            *in_both_modules("shared-memory-all-reduce", "all_reduce", _all_reduce,
                             "a SUM all-reduce on one host: one copy in, a share summed, one copy out"),
            *in_both_modules("shared-memory-all-gather", "all_gather_into_tensor", _all_gather_into_tensor,
                             "an all-gather on one host: one copy in, one copy out"),
            *in_both_modules("shared-memory-reduce-scatter", "reduce_scatter_tensor", _reduce_scatter_tensor,
                             "a SUM reduce-scatter on one host"),
            *in_both_modules("shared-memory-release", "destroy_process_group", _destroy_process_group,
                             "the group's segment is unmapped with the group"),
        ),
    )
