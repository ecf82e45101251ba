"""Asynchronous reads and writes between host tensors and files, on the native thread pool of ``_native/aio.c``.

Engine-agnostic: devshim's DeepSpeed integration serves DeepSpeed's ``async_io`` op with it (ZeRO-Infinity's NVMe
offload). The library is compiled when devshim-kernels is installed; if it was not (no C compiler, or not POSIX),
``AVAILABLE`` is false and ``REASON`` says why.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from typing import cast

import torch

from devshim_kernels._native import open_library

ABI_VERSION = 2  # must equal DEVSHIM_AIO_ABI in aio.c: a library from before O_NOFOLLOW is not used


def _load() -> tuple[ctypes.CDLL | None, str]:
    library, reason = open_library("_aio", "devshim_aio_abi_version", ABI_VERSION, "the native file I/O library")
    if library is None:
        return None, reason
    library.devshim_aio_create.restype = ctypes.c_void_p
    library.devshim_aio_create.argtypes = [ctypes.c_int, ctypes.c_int64]
    library.devshim_aio_threads.restype = ctypes.c_int
    library.devshim_aio_threads.argtypes = [ctypes.c_void_p]
    library.devshim_aio_submit.restype = ctypes.c_int
    library.devshim_aio_submit.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    library.devshim_aio_wait.restype = ctypes.c_int64
    library.devshim_aio_wait.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64)]
    library.devshim_aio_destroy.restype = None
    library.devshim_aio_destroy.argtypes = [ctypes.c_void_p]
    return library, ""


_LIBRARY, REASON = _load()
AVAILABLE = _LIBRARY is not None


def describe() -> str:
    """What serves file I/O, or why nothing does (for ``devshim info``)."""
    if AVAILABLE:
        return "devshim_kernels, native thread pool (pread/pwrite; O_DIRECT for whole pages)"
    return f"unavailable: {REASON}"


@dataclass(frozen=True)
class _Pending:
    read: bool
    target: str  # the path, or "file descriptor N"
    buffer: torch.Tensor  # kept alive until the transfer is waited for


class AsyncFileIO:
    """A pool of ``threads`` I/O threads moving ``block_size``-byte chunks of host tensors to and from files.

    ``submit`` queues a transfer and returns at once; ``wait`` blocks until every queued transfer is done and
    returns how many there were. A failure is raised by ``wait`` as an :class:`OSError` naming the file.
    Not thread-safe: one thread submits and waits.
    """

    def __init__(self, threads: int = 1, block_size: int = 1 << 20) -> None:
        if _LIBRARY is None:
            raise RuntimeError(f"devshim's asynchronous file I/O is unavailable: {REASON}")
        if threads < 1 or block_size < 1:
            raise ValueError(f"threads ({threads}) and block_size ({block_size}) must be positive")
        self._handle = _LIBRARY.devshim_aio_create(threads, block_size)
        if not self._handle:
            raise OSError(f"devshim's asynchronous file I/O could not start {threads} threads")
        self.block_size = block_size
        self.threads = _LIBRARY.devshim_aio_threads(self._handle)
        self._pending: list[_Pending] = []

    def submit(self, read: bool, buffer: torch.Tensor, target: str | os.PathLike[str] | int,
               file_offset: int = 0) -> None:
        """Queue a read of ``target`` into ``buffer`` or a write of ``buffer`` to it, at ``file_offset``.

        ``target`` is a path (opened here, created for a write, closed by ``wait``) or an open descriptor (left
        open). ``buffer`` must be a contiguous CPU tensor and must not be touched until ``wait`` returns.
        """
        if self._handle is None:
            raise RuntimeError("this AsyncFileIO is closed")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(f"AsyncFileIO needs a contiguous CPU tensor, got device {buffer.device}, "
                             f"contiguous={buffer.is_contiguous()}")
        if isinstance(target, int):
            path, fd, name = None, target, f"file descriptor {target}"
        else:
            name = os.fspath(target)
            path, fd = os.fsencode(name), -1
        library = cast(ctypes.CDLL, _LIBRARY)  # not None: __init__ made a handle with it
        error = library.devshim_aio_submit(self._handle, int(read), path, fd, buffer.data_ptr(), buffer.nbytes,
                                           file_offset)
        if error:
            raise open_error(error, name, read)
        self._pending.append(_Pending(read, name, buffer))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def wait(self) -> int:
        """Block until every submitted transfer is done; return how many there were."""
        if self._handle is None:
            raise RuntimeError("this AsyncFileIO is closed")
        error, index = ctypes.c_int(0), ctypes.c_int64(-1)
        library = cast(ctypes.CDLL, _LIBRARY)  # not None: __init__ made a handle with it
        count = library.devshim_aio_wait(self._handle, ctypes.byref(error), ctypes.byref(index))
        pending, self._pending = self._pending, []
        assert count == len(pending), (count, len(pending))
        if error.value:
            failed = pending[index.value]
            what = "reading" if failed.read else "writing"
            detail = "the file is shorter than the buffer" if error.value == errno.ENODATA else os.strerror(error.value)
            raise OSError(error.value, f"asynchronous {what} of {failed.buffer.nbytes} bytes failed: {detail}",
                          failed.target)
        return count

    def close(self) -> None:
        """Finish the queued transfers and stop the threads (errors of unwaited transfers are dropped)."""
        if self._handle is not None and _LIBRARY is not None:
            _LIBRARY.devshim_aio_destroy(self._handle)
            self._handle = None
            self._pending = []

    def __del__(self) -> None:
        self.close()


def open_error(error: int, path: str, read: bool) -> OSError:
    """The error for a path the engine could not open; a symlink at the path (which it never follows) says so."""
    what = "reading" if read else "writing"
    try:
        link = os.readlink(path) if error == errno.ELOOP else None
    except OSError:  # not a link: a loop in the directories above it
        link = None
    if link is not None:
        return OSError(error, f"refused to open for {what}: the path is a symbolic link (to {link!r}), "
                              "and devshim's file I/O never follows one, so that swap data can neither overwrite "
                              "nor be read from the file it points to. Remove the link, or point DeepSpeed's "
                              "nvme_path at a directory where devshim can create its own files", path)
    return OSError(error, f"cannot open for {what}: {os.strerror(error)}", path)


def aligned_empty(numel: int, dtype: torch.dtype, alignment: int = 4096) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on an ``alignment``-byte boundary, so that whole-page
    transfers of it can bypass the page cache (O_DIRECT)."""
    itemsize = dtype.itemsize
    if alignment % itemsize:
        raise ValueError(f"alignment {alignment} is not a multiple of {dtype}'s size")
    storage = torch.empty(numel + alignment // itemsize, dtype=dtype)
    skip = (-storage.data_ptr() % alignment) // itemsize
    return storage[skip:skip + numel]
