"""Checksums of checkpoint files, and the words for what went wrong with one: framework-neutral.

A record is a file's size and sha256, taken by reading the file back once the framework has written it, and written
atomically (a temporary file, fsync, rename) into a ``.devshim-checksums`` directory: a crash leaves the old record or
the new one, never half of one. Before a load the file is checked against it: the size first (a truncated file is
named as such without reading it), then the sha256. A file without a record (saved without devshim) is not checked.

A save that fails is named as a full disk when the failure says so (ENOSPC, EDQUOT or EFBIG anywhere in the exception
chain) or when the checkpoint's filesystem is found full afterwards: torch's zip writer reports a short write as
``unexpected pos 128 vs 0``, without an errno.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import re
import resource
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKSUM_DIR = ".devshim-checksums"  # hidden: no framework's glob and no `global_step*`/`iter_*` listing sees it
FORMAT = 1
SHM = Path("/dev/shm")
FULL_BELOW = 1 << 20  # a filesystem with less free space than this is full for a checkpoint
_CHUNK = 4 << 20
_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
             errno.EFBIG: "file too large"}


# -- records ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Digest:
    size: int
    sha256: str

    def as_json(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: Any) -> Digest:
        if not (isinstance(data, dict) and isinstance(data.get("bytes"), int)
                and isinstance(data.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", data["sha256"])):
            raise ValueError(f"not a checksum record: {str(data)[:80]}")
        return cls(data["bytes"], data["sha256"])


def digest(path: Path) -> Digest:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return Digest(size, sha.hexdigest())


def write_json(path: Path, data: Any) -> None:
    """``data`` as ``path``, whole or not at all: written to a temporary file beside it, synced, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def read_json(path: Path) -> Any:
    """A record devshim wrote; a ValueError that names it when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"devshim's checksum record {path} is corrupt or unreadable ({type(exc).__name__}: "
                         f"{exc})") from exc


def read_digest(path: Path) -> Digest:
    """The record of one file (a DeepSpeed file's own record); a ValueError that names it when it cannot be read."""
    data = read_json(path)
    try:
        return Digest.from_json(data)
    except ValueError as exc:
        raise ValueError(f"devshim's checksum record {path} is corrupt ({exc})") from exc


def mismatch(path: Path, recorded: Digest) -> str | None:
    """What differs between ``path`` and the record taken when it was saved, said of the file; ``None`` if nothing."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing ({recorded.size} bytes were saved)"
    if size < recorded.size:
        return f"{path} is truncated: {size} bytes on disk, {recorded.size} were saved"
    if size > recorded.size:
        return f"{path} is corrupt: {size} bytes on disk, {recorded.size} were saved"
    actual = digest(path)
    if actual.sha256 != recorded.sha256:
        return (f"{path} is corrupt: its sha256 checksum is {actual.sha256[:16]}..., but {recorded.sha256[:16]}... "
                "was recorded when it was saved")
    return None


def unreadable(exc: BaseException) -> bool:
    """Whether a ``torch.load`` failed on the file's bytes (truncated or corrupt), not for another reason (a class
    that cannot be imported, a device that is not there)."""
    if isinstance(exc, (pickle.UnpicklingError, EOFError, UnicodeDecodeError, zipfile.BadZipFile)):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL:  # torch's zip reader on a cut central directory
        return True
    return isinstance(exc, RuntimeError) and bool(re.search(
        r"PytorchStreamReader|zip archive|archive is corrupted|invalid header|unexpected EOF|"
        r"storage has wrong byte size", str(exc), re.IGNORECASE))


# -- names and sizes -------------------------------------------------------------------------------------------


def rank_prefix() -> str:
    """'rank 1: ' in a job of several ranks, '' otherwise: which rank's error the user is reading."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank {dist.get_rank()}: "
    return ""


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def natural(name: str) -> list[Any]:
    """Sort key that puts global_step9 before global_step10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def size_text(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


# -- a save that failed ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoSpace:
    """Why a write failed for want of room: ``reason`` ("no space left on device", ...), ``where`` (the directory
    or filesystem that is full), its free bytes, and a ``detail`` that says more (a file size limit)."""

    reason: str
    where: Path
    free: int | None
    detail: str = ""

    def describe(self) -> str:
        if self.detail:
            return f"{self.reason} ({self.detail})"
        return f"{self.reason} on the filesystem of {self.where} ({size_text(self.free)} free)"


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures a torch.distributed.checkpoint
    ``CheckpointException`` gathered (a writer's own error, raised in a worker or on another rank)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] for f in failures.values()
                        if isinstance(f, tuple) and f and isinstance(f[0], BaseException))
        todo.extend(e for e in (current.__context__, current.__cause__) if e is not None)


def failed(exc: BaseException) -> bool:
    """An error a save or load raised, not an interruption: torch.distributed.checkpoint's CheckpointException is a
    BaseException."""
    return not isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


def free_bytes(path: Path) -> int | None:
    """Free space for an unprivileged writer on the filesystem of ``path`` (or of its nearest existing parent)."""
    for candidate in (path, *path.parents):
        try:
            stat = os.statvfs(candidate)
        except OSError:
            continue
        return stat.f_bavail * stat.f_frsize
    return None


def _raised_in_multiprocessing(exc: BaseException) -> bool:
    """A semaphore or queue of ``multiprocessing`` failed: those live in ``/dev/shm``."""
    for error in chain(exc):
        tb: types.TracebackType | None = error.__traceback__
        while tb is not None:
            if f"{os.sep}multiprocessing{os.sep}" in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
    return False


def _file_size_limit_reached(target: Path) -> NoSpace | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft == resource.RLIM_INFINITY:
        return None
    files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file()] if target.is_dir() else []
    for file in files:
        with contextlib.suppress(OSError):
            if file.stat().st_size >= soft:
                return NoSpace("file too large", file, free_bytes(file),
                               f"{file} reached this process's file size limit, {size_text(soft)} (RLIMIT_FSIZE, "
                               "`ulimit -f`)")
    return None


def no_space(exc: BaseException, target: Path) -> NoSpace | None:
    """Whether the write of ``target`` (a file, or the directory a checkpoint is written into) failed for want of
    room, and where; ``None`` if it failed for another reason."""
    found = next((e for e in chain(exc) if isinstance(e, OSError) and e.errno in _NO_SPACE), None)
    place = target if target.is_dir() else target.parent  # where the user frees space
    free = free_bytes(place)
    target_full = free is not None and free < FULL_BELOW
    if isinstance(found, OSError):
        code = found.errno if found.errno in _NO_SPACE else errno.ENOSPC  # it is: found by it; for the type checker
        reason = _NO_SPACE[code]
        if code == errno.EFBIG and (limit := _file_size_limit_reached(target)) is not None:
            return limit
        if found.filename:
            where = Path(os.fsdecode(found.filename))
            where = where if where.is_dir() else where.parent
        elif _raised_in_multiprocessing(exc) or (not target_full and (free_bytes(SHM) or FULL_BELOW) < FULL_BELOW):
            where = SHM
        else:
            where = place
        return NoSpace(reason, where, free_bytes(where))
    if target_full:
        return NoSpace(_NO_SPACE[errno.ENOSPC], place, free)
    return _file_size_limit_reached(target)
