"""A group's shared-memory segment: its files, its set-up and release, and the protocol every call follows.

Layout of one segment (a file in ``/dev/shm`` that every rank maps, unlinked once all did)::

    counters   one 64-bit arrival counter per rank, each on its own 128-byte line
    wake       the futex the waiting ranks sleep on, on a line of its own
    headers    two generations x one 64-byte header per rank: what this rank's call is
    slots      two generations x one SLOT_BYTES data slot per rank

A call is one or more *rounds*; round ``r`` uses generation ``r % 2``. In its first round every rank writes its
header (and, when it expects the shared path, its first piece of data), then all meet at a barrier and each reads
every header. Identical headers that all allow the shared path: the data moves through the slots. Identical
headers where one rank cannot (a non-contiguous tensor, say): every rank calls gloo. Different headers: every rank
raises :class:`~devshim_core.errors.CollectiveMismatchError` at the same call, naming what differs. A rank
rewrites generation ``g`` only after the barrier of the next round, which every rank reaches after it finished
reading ``g``.

Barriers are the counters of ``_shm_sync`` (a C extension; waiters spin briefly, then sleep on a futex the
last arrival wakes): a gloo barrier would cost more than a small collective. A rank waiting at one checks, every
``LIVENESS_S``, that the ranks it waits for still run, and gives up after the process group's timeout; either way
it raises :class:`~devshim_core.errors.CollectiveError` naming those ranks, unmaps the segment, and later calls on
the group raise it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from devshim_core.errors import CollectiveError

try:
    from devshim_core.integrations.torch_distributed import _shm_sync  # type: ignore[attr-defined]  # a C extension: mypy reads no .so
except ImportError:  # built at install; without a C compiler the collectives stay gloo's
    _shm_sync = None

NATIVE = _shm_sync is not None
SLOT_BYTES = 4 << 20  # per rank and generation: a 2-rank group maps 16 MiB
COUNTER_STRIDE = 128  # one arrival counter per line, so that ranks do not share a cache line
HEADER_FIELDS = 8  # int64 each: see Header
LIVENESS_S = 0.5
SHM_DIRECTORY = "/dev/shm"
FILE_PREFIX = "devshim-collectives"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class Header:
    """What one rank's call is; every rank of a well-formed collective writes the same, but for ``eligible``."""

    seq: int  # the group's call number, from 1
    kind: int  # index in KINDS
    op: int  # the reduction, or -1
    dtype: int  # dtype_code(); -1 for none
    count: int  # elements of this rank's share
    whole: int  # elements of the gathered or scattered whole, or -1
    eligible: int  # 1 if this rank's tensors can take the shared path (local rules)

    def fields(self) -> list[int]:
        return [self.seq, self.kind, self.op, self.dtype, self.count, self.whole, self.eligible, 0]

    def agreed(self) -> tuple[int, ...]:
        """What every rank must agree on."""
        return self.seq, self.kind, self.op, self.dtype, self.count, self.whole


KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def host_identity() -> tuple[str, str]:
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:  # no procfs: the host name alone must match
        boot = ""
    return socket.gethostname(), boot


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not yet reaped by its launcher, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class Segment:
    """One group's mapped segment, and the rounds of its calls. Not thread-safe: ``Segments`` locks per group."""

    def __init__(self, data: Any, group: Any, rank: int, size: int, pids: list[int], timeout_s: float) -> None:
        self.data, self.group, self.rank, self.size, self.pids = data, group, rank, size, pids
        self.timeout_s = timeout_s
        self._wake = data.data_ptr() + size * COUNTER_STRIDE
        self.header_offset = (size + 1) * COUNTER_STRIDE
        self.slot_offset = _control_bytes(size)
        self._address = data.data_ptr()
        # the headers through ctypes: a few integers, where a torch op would cost microseconds each
        self._headers: Any = (ctypes.c_int64 * (2 * size * HEADER_FIELDS)).from_address(
            self._address + self.header_offset)
        self.rounds = 0  # rounds begun; the generation of round r is r % 2
        self.arrivals = 0  # barriers passed
        self.calls = 0
        self.failure: str | None = None

    # -- rounds ------------------------------------------------------------------------------------------------
    def begin_round(self) -> int:
        generation = self.rounds % 2
        self.rounds += 1
        return generation

    def slots(self, generation: int, dtype: Any) -> Any:
        """Generation ``generation``'s slots as a ``(size, SLOT_BYTES // itemsize)`` tensor of ``dtype``."""
        span = self.size * SLOT_BYTES
        start = self.slot_offset + generation * span
        return self.data[start:start + span].view(dtype).view(self.size, -1)

    def write_header(self, generation: int, header: Header) -> None:
        start = (generation * self.size + self.rank) * HEADER_FIELDS
        self._headers[start:start + HEADER_FIELDS] = header.fields()

    def read_headers(self, generation: int) -> list[Header]:
        start = generation * self.size * HEADER_FIELDS
        values = self._headers[start:start + self.size * HEADER_FIELDS]
        return [Header(*values[k * HEADER_FIELDS:k * HEADER_FIELDS + 7]) for k in range(self.size)]

    def barrier(self, what: str) -> None:
        """Meet every rank of the group; raise :class:`CollectiveError` naming the ranks that do not come."""
        assert _shm_sync is not None
        self.arrivals += 1
        target = self.arrivals
        _shm_sync.arrive(self._address + self.rank * COUNTER_STRIDE, target, self._wake)
        if _shm_sync.wait(self._address, self.size, COUNTER_STRIDE, target, LIVENESS_S, self._wake) < 0:
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            lagging = self._lagging(target)
            if not lagging:
                return
            dead = [rank for rank in lagging if not is_alive(self.pids[rank])]
            if dead:
                raise self._fail(f"{what}: {_ranks(dead)} of this {self.size}-rank group exited (process "
                                 f"{', '.join(str(self.pids[r]) for r in dead)}) before reaching it; its error, if it "
                                 "printed one, is in its own log")
            if time.monotonic() >= deadline:
                raise self._fail(f"{what} timed out after {self.timeout_s:.0f} s: {_ranks(lagging)} of this "
                                 f"{self.size}-rank group did not reach it. Every rank must make the same collectives "
                                 "in the same order (an async_op=True call on one rank only counts as missing)")
            _shm_sync.wait(self._address, self.size, COUNTER_STRIDE, target, LIVENESS_S, self._wake)

    def _lagging(self, target: int) -> list[int]:
        assert _shm_sync is not None
        return [rank for rank in range(self.size)
                if _shm_sync.load(self._address + rank * COUNTER_STRIDE) < target]

    def _fail(self, message: str) -> CollectiveError:
        """Record the failure and unmap the segment: the group's lock is held, and every later call on the group
        raises on ``failure`` before it would touch the mapping."""
        self.failure = message
        self._headers = None
        self.data = None  # the last reference to the mapping: torch unmaps it
        return CollectiveError(message)

    # -- the data paths: each runs after the first round's barrier, in that round ------------------------------
    def all_reduce(self, flat: Any, generation: int, what: str) -> None:
        per = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per):
            piece = flat[start:start + per]
            length = piece.numel()
            if start:
                generation = self.begin_round()
                self.slots(generation, flat.dtype)[self.rank, :length].copy_(piece)
                self.barrier(what)
            slots = self.slots(generation, flat.dtype)
            low, high = length * self.rank // self.size, length * (self.rank + 1) // self.size
            if high > low:  # this rank's share, summed into slot 0 in rank order
                total = slots[0, low:high]
                for k in range(1, self.size):
                    total.add_(slots[k, low:high])
            self.barrier(what)
            piece.copy_(slots[0, :length])

    def all_gather(self, output: Any, flat: Any, generation: int, what: str) -> None:
        count = flat.numel()
        per = SLOT_BYTES // flat.element_size()
        gathered = output.view(self.size, count)
        for start in range(0, count, per):
            length = min(per, count - start)
            if start:
                generation = self.begin_round()
                self.slots(generation, flat.dtype)[self.rank, :length].copy_(flat[start:start + length])
                self.barrier(what)
            gathered[:, start:start + length].copy_(self.slots(generation, flat.dtype)[:, :length])

    def reduce_scatter(self, output: Any, flat: Any, generation: int, what: str) -> None:
        count = output.numel()
        per = self.per_rank_piece(flat.element_size())
        parts = flat.view(self.size, count)
        for start in range(0, count, per):
            length = min(per, count - start)
            if start:
                generation = self.begin_round()
                self.write_reduce_scatter_piece(generation, parts, start, length)
                self.barrier(what)
            slots = self.slots(generation, flat.dtype)
            mine = slice(self.rank * length, (self.rank + 1) * length)
            total = output[start:start + length]
            total.copy_(slots[0, mine])
            for k in range(1, self.size):
                total.add_(slots[k, mine])

    def per_rank_piece(self, itemsize: int) -> int:
        return SLOT_BYTES // itemsize // self.size

    def write_reduce_scatter_piece(self, generation: int, parts: Any, start: int, length: int) -> None:
        slot = self.slots(generation, parts.dtype)[self.rank, :self.size * length]
        slot.view(self.size, length).copy_(parts[:, start:start + length])


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _control_bytes(size: int) -> int:
    raw = (size + 1) * COUNTER_STRIDE + 2 * size * HEADER_FIELDS * 8
    return (raw + 4095) // 4096 * 4096


def segment_bytes(size: int) -> int:
    return _control_bytes(size) + 2 * size * SLOT_BYTES


def group_timeout_s(group: Any) -> float:
    """The process group's own timeout (init_process_group's ``timeout``), else torch's default for gloo."""
    import torch

    with contextlib.suppress(Exception):  # a private API: fall back to the default below
        return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    from torch.distributed.constants import default_pg_timeout

    return float(default_pg_timeout.total_seconds())


class Segments:
    """Each group's segment, or ``None`` where the group keeps gloo; set up collectively on a group's first call.

    One lock per group, held for set-up and for each call: two threads serving two groups never wait for each
    other, and two calls of one process on one group never share a generation.
    """

    def __init__(self, directory: str = SHM_DIRECTORY) -> None:
        self.directory = directory
        self._by_group: dict[int, tuple[Any, Segment | None]] = {}  # id(group) -> (group kept alive, segment)
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()  # only around the two dicts, never across a collective

    def keeps_gloo(self, group: Any) -> bool:
        """Whether ``group`` was set up and has no segment: its calls go to gloo without taking its lock."""
        found = self._by_group.get(id(group))
        return found is not None and found[1] is None

    @contextlib.contextmanager
    def of(self, group: Any) -> Iterator[Segment | None]:
        """The group's segment, set up on first use, with the group's lock held."""
        with self._guard:
            lock = self._locks.setdefault(id(group), threading.Lock())
        with lock:
            found = self._by_group.get(id(group))
            if found is None:
                found = (group, self._set_up(group))
                with self._guard:
                    self._by_group[id(group)] = found
            yield found[1]

    def release(self, group: Any = None) -> None:
        """Unmap ``group``'s segment (every group's when ``None``), as ``destroy_process_group`` does."""
        with self._guard:
            keys = list(self._by_group) if group is None else [id(group)]
            for key in keys:
                self._by_group.pop(key, None)
                self._locks.pop(key, None)

    def mapped(self) -> int:
        """How many groups hold a mapped segment (for specs of release)."""
        with self._guard:
            return sum(segment is not None for _, segment in self._by_group.values())

    def _set_up(self, group: Any) -> Segment | None:
        import torch
        import torch.distributed as dist

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size < 2 or dist.get_backend(group) != "gloo":
            return None
        facts: list[Any] = [None] * size
        dist.all_gather_object(facts, (host_identity(), os.getpid(), NATIVE), group=group)
        if len({fact[0] for fact in facts}) != 1 or not all(fact[2] for fact in facts):
            return None  # ranks on several hosts, or one without the native barrier: gloo for every call
        total = segment_bytes(size)
        path = [self._create(total) if rank == 0 else None]
        try:
            dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
            data = None
            if path[0] is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    data = torch.from_file(path[0], shared=True, size=total, dtype=torch.uint8)
            mapped: list[Any] = [None] * size
            dist.all_gather_object(mapped, data is not None, group=group)  # all ranks mapped it, or none uses it
        finally:  # on every path, a crash of a peer included: nothing stays in /dev/shm
            if rank == 0 and path[0] is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path[0])
        if not all(mapped):
            return None
        return Segment(data, group, rank, size, [fact[1] for fact in facts], group_timeout_s(group))

    def _create(self, total: int) -> str | None:
        self.sweep()
        name = f"{FILE_PREFIX}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
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

    def sweep(self) -> list[str]:
        """Unlink the segments this user's processes on this host left when killed between creating and unlinking
        them (their creator no longer runs); return their paths."""
        prefix = f"{FILE_PREFIX}-{socket.gethostname()}-"
        removed: list[str] = []
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return removed
        for entry in entries:
            if not entry.name.startswith(prefix):
                continue
            pid_text = entry.name[len(prefix):].split("-", 1)[0]
            with contextlib.suppress(OSError, ValueError):
                if entry.stat(follow_symlinks=False).st_uid == os.getuid() and not is_alive(int(pid_text)):
                    os.unlink(entry.path)
                    removed.append(entry.path)
        return removed


SEGMENTS = Segments()
