"""A Python object with the API of DeepSpeed's compiled ``async_io`` op, run on the plugin's offload file I/O.

ZeRO-Infinity's NVMe swappers (``deepspeed.runtime.swap_tensor``), the fast checkpoint writer
(``deepspeed.io``) and ``deepspeed.nvme``'s tools call this API directly, so names, signatures, defaults and
return values follow ``csrc/aio/py_lib/py_ds_aio.cpp``. Where the compiled op prints and returns -1, or asserts,
this one raises :class:`OSError` or :class:`ValueError` naming the file. Unlike the compiled op, it never follows a
symlink at a swap path: it raises instead of overwriting (or reading) the link's target.
"""

from __future__ import annotations

import errno
import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from devshim_core.records import AsyncFileIO

O_DIRECT_ALIGNMENT = 512  # DeepSpeed's get_alignment() is intra_op_parallelism times this
PAGE = 4096
# The engine runs queue_depth-many chunks at once per intra-op thread, as libaio keeps queue_depth requests in
# flight, but caps the threads this costs. The cap is a choice, not a measured optimum (bench/file_io.py compares
# only DeepSpeed's default configuration, where it gives 4 threads).
MAX_THREADS_PER_STREAM = 4


@dataclass
class _Transfer:
    read: bool
    target: str | int
    user_buffer: torch.Tensor
    io_buffer: torch.Tensor  # user_buffer itself, or a contiguous host bounce copy
    validate: bool
    file_offset: int


def _host_view(buffer: torch.Tensor, read: bool) -> torch.Tensor:
    """The contiguous host tensor the engine moves: the buffer itself when it is one, else a bounce copy."""
    if buffer.device.type == "cpu" and buffer.is_contiguous():
        return buffer
    bounce = torch.empty(buffer.shape, dtype=buffer.dtype)
    if not read:
        bounce.copy_(buffer)
    return bounce


def _symlink_refusal(path: str, read: bool) -> OSError | None:
    """The error for a symlink at a swap path, or ``None``: the engine opens paths with ``O_NOFOLLOW`` (devshim's
    refuses a link when it opens the file); this check names the link before anything is queued, whichever engine
    the plugin gave."""
    try:
        link = os.readlink(path)
    except OSError:  # not a link, or not there
        return None
    return OSError(errno.ELOOP, f"refused to open for {'reading' if read else 'writing'}: the path is a symbolic "
                                f"link (to {link!r}), and devshim's async I/O never follows one, so that swap data "
                                "can neither overwrite nor be read from the file it points to. Remove the link, or "
                                "point DeepSpeed's nvme_path at a directory where devshim can create its own files",
                   path)


def _file_size(filename: str) -> int:
    refusal = _symlink_refusal(filename, read=True)
    if refusal is not None:
        raise refusal
    try:
        return os.stat(filename).st_size
    except OSError as error:
        raise OSError(error.errno, f"cannot read: {error.strerror}", filename) from None


def _validate(transfer: _Transfer) -> None:
    """Compare the buffer with the file as a plain read sees it (the op's ``validate=True``)."""
    if isinstance(transfer.target, int):
        return
    expected = transfer.io_buffer.view(torch.uint8).reshape(-1)
    try:
        descriptor = os.open(transfer.target, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as error:
        refusal = _symlink_refusal(transfer.target, read=True)
        raise refusal or OSError(error.errno, f"cannot validate: {error.strerror}", transfer.target) from None
    with open(descriptor, "rb") as file:
        file.seek(transfer.file_offset)
        data = file.read(expected.numel())
    actual = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if not torch.equal(actual, expected):
        what = "read" if transfer.read else "write"
        raise OSError(f"validation of the {what} failed: the buffer differs from the file", transfer.target)


class AioHandle:
    """``aio_handle``: parallel, optionally asynchronous reads and writes of whole tensors."""

    def __init__(self, block_size: int = 1024 * 1024, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1, *,
                 file_io: Any, pinned: Any) -> None:
        if block_size < 1 or queue_depth < 1 or intra_op_parallelism < 1:
            raise ValueError(f"aio_handle: block_size ({block_size}), queue_depth ({queue_depth}) and "
                             f"intra_op_parallelism ({intra_op_parallelism}) must be positive")
        self._block_size = int(block_size)
        self._queue_depth = int(queue_depth)
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._intra_op_parallelism = int(intra_op_parallelism)
        threads = self._intra_op_parallelism * min(self._queue_depth, MAX_THREADS_PER_STREAM)
        self._engine: AsyncFileIO = file_io(threads, self._block_size)
        self._pinned: PinnedBuffers = pinned
        self._pending: list[_Transfer] = []

    # -- configuration, as given ---------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        return self._intra_op_parallelism * O_DIRECT_ALIGNMENT

    # -- transfers ------------------------------------------------------------------------------
    def _submit(self, read: bool, buffer: torch.Tensor, target: str | int, validate: bool, file_offset: int) -> None:
        if not read and not isinstance(target, int) and (refusal := _symlink_refusal(target, read=False)):
            raise refusal
        if read and not isinstance(target, int):
            size = _file_size(target)
            if size < file_offset + buffer.nbytes:
                raise OSError(f"cannot read {buffer.nbytes} bytes at offset {file_offset}: "
                              f"the file has {size} bytes", target)
        io_buffer = _host_view(buffer, read)
        self._engine.submit(read, io_buffer, target, file_offset)
        self._pending.append(_Transfer(read, target, buffer, io_buffer, validate, file_offset))

    def wait(self) -> int:
        """Wait for every submitted transfer; return how many there were."""
        pending, self._pending = self._pending, []
        count = self._engine.wait()
        for transfer in pending:
            if transfer.read and transfer.io_buffer is not transfer.user_buffer:
                transfer.user_buffer.copy_(transfer.io_buffer)
            if transfer.validate:
                _validate(transfer)
        return count

    def _run(self, read: bool, buffer: torch.Tensor, target: str | int, validate: bool, run_async: bool,
             file_offset: int) -> int:
        self._submit(read, buffer, target, validate, file_offset)
        return 0 if run_async else self.wait()

    def read(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Synchronous read of the whole file into ``buffer``, which must be the file's size; returns 0."""
        size = _file_size(filename)
        if size != buffer.nbytes:
            raise ValueError(f"aio_handle.read: the buffer has {buffer.nbytes} bytes and {filename!r} {size}")
        self._run(True, buffer, filename, validate, False, file_offset)
        return 0

    def write(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        self._run(False, buffer, filename, validate, False, file_offset)
        return 0

    def pread(self, buffer: torch.Tensor, filename: str, validate: bool, run_async: bool,
              file_offset: int = 0) -> int:
        """Parallel read; asynchronous (``async``, passed positionally) returns 0 and ``wait()`` completes it,
        synchronous returns the count of completed transfers."""
        return self._run(True, buffer, filename, validate, run_async, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename: str | int, validate: bool, run_async: bool,
               file_offset: int = 0) -> int:
        return self._run(False, buffer, filename, validate, run_async, file_offset)

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._run(True, buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._run(False, buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._run(True, buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: str | int, file_offset: int = 0, *,
                     fd: int | None = None) -> int:
        """Asynchronous write to a path, or to an open descriptor (``fd``, or an int in place of the path)."""
        return self._run(False, buffer, filename if fd is None else fd, False, True, file_offset)

    # -- pinned host buffers --------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return self._pinned.alloc(int(num_elem), example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return self._pinned.free(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` needs no bounce copy: torch-pinned, or inside a buffer this op allocated."""
        return buffer.device.type == "cpu" and (buffer.is_pinned() or self._pinned.is_managed(buffer))

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()


class PinnedBuffers:
    """The op's host buffers: page-aligned (so that whole-page transfers bypass the page cache) and pinned when
    the device pins host memory. Shared by every handle of the op, like DeepSpeed's pinned-tensor manager."""

    def __init__(self, pin: Any) -> None:
        self._pin = pin  # the accelerator's pin_memory, or None when the device does not pin
        self._buffers: dict[int, torch.Tensor] = {}  # data_ptr -> the allocation, kept alive until freed
        _ALL_BUFFERS.add(self)

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = dtype.itemsize
        storage = torch.empty(numel + PAGE // itemsize, dtype=dtype)
        if self._pin is not None:
            storage = self._pin(storage)
        skip = (-storage.data_ptr() % PAGE) // itemsize
        tensor = storage[skip:skip + numel]
        self._buffers[tensor.data_ptr()] = tensor
        return tensor

    def free(self, tensor: torch.Tensor) -> bool:
        return self._buffers.pop(tensor.data_ptr(), None) is not None

    def is_managed(self, buffer: torch.Tensor) -> bool:
        return any(_within(buffer, base, t.nbytes) for base, t in self._buffers.items())


def _within(tensor: torch.Tensor, base: int, nbytes: int) -> bool:
    """Whether all of ``tensor``'s bytes lie in the ``nbytes`` from address ``base``."""
    return base <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= base + nbytes


_ALL_BUFFERS: weakref.WeakSet[PinnedBuffers] = weakref.WeakSet()
_IO_READY: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}  # data_ptr -> (tensor, nbytes): mark_io_ready


def mark_io_ready(tensor: torch.Tensor) -> torch.Tensor:
    """Record a host tensor as usable for the op's transfers (:func:`is_locked_buffer` says so while it lives) and
    return it: what DeepSpeed 0.16-0.18 get from ``accelerator.pin_memory`` on a device that does not pin host
    memory, as from DeepSpeed's own CPU accelerator (the tensor itself); their NVMe swap buffers must then pass
    ``accelerator.is_pinned``, an assert DeepSpeed's own CPU accelerator fails."""
    for stale in [ptr for ptr, (ref, _) in _IO_READY.items() if ref() is None]:
        del _IO_READY[stale]
    _IO_READY[tensor.data_ptr()] = (weakref.ref(tensor), tensor.nbytes)
    return tensor


def is_locked_buffer(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in a buffer an ``async_io`` op allocated (``new_cpu_locked_tensor``)."""
    if tensor.device.type != "cpu":
        return False
    if any(_within(tensor, base, nbytes) for base, (ref, nbytes) in list(_IO_READY.items()) if ref() is not None):
        return True
    return any(buffers.is_managed(tensor) for buffers in list(_ALL_BUFFERS))


def _copy(dest: torch.Tensor, src: torch.Tensor) -> int:
    dest.copy_(src)
    return 0


class AsyncIOOp:
    """The ``async_io`` module: ``aio_handle``, ``aio_read``, ``aio_write`` and ``deepspeed_memcpy``."""

    def __init__(self, file_io: Any, pin: Any) -> None:
        self._pinned = PinnedBuffers(pin)
        self.aio_handle = functools.partial(AioHandle, file_io=file_io, pinned=self._pinned)
        self.deepspeed_memcpy = _copy

    def aio_read(self, buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
                 overlap_events: bool, validate: bool) -> int:
        return self.aio_handle(block_size, queue_depth, single_submit, overlap_events).read(buffer, filename, validate)

    def aio_write(self, buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
                  overlap_events: bool, validate: bool) -> int:
        return self.aio_handle(block_size, queue_depth, single_submit, overlap_events).write(buffer, filename,
                                                                                            validate)
