"""The emulator cache's files, reached so that what devshim checks is what it uses.

Every directory is opened relative to its parent's descriptor with ``O_NOFOLLOW`` and judged by ``fstat`` on the
descriptor; everything after that (the lock, the build, the manifest, the library) is opened relative to the
verified directory's descriptor. Renaming or replacing a path component after the check therefore changes nothing
devshim reads: it holds the directories it checked.

Who may write where:

- the cache root and everything devshim keeps under it must be this user's and writable by no one else;
- above the cache root, each directory up to the first one only root or this user can write is checked the same
  way (a root-owned sticky directory such as ``/tmp`` also ends the check when the entry below it is this user's:
  others can add names there but cannot replace ours);
- a symbolic link on the way to the cache root is followed only where only root or this user could have made it
  (in a directory only they can write, or this user's own link in a root-owned sticky directory); under the cache
  root devshim follows none.

Each problem is a :class:`CacheProblem` whose message names the path and what to do; ``build`` raises it as an
``EmulationBuildError``. A cached library that does not match its manifest is :class:`Stale`: rebuilt, not an error.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
_O_PATH = getattr(os, "O_PATH", 0)
# O_PATH: only ancestors' search permission is needed, not read permission on each directory (a 0711 home)
_DIRECTORY = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | (_O_PATH or os.O_RDONLY)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # as the kernel's own limit on symbolic links in one lookup
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OWN_DIRECTORY = "Point DEVSHIM_CACHE_DIR at a directory of your own (it is created with mode 0700)."


class CacheProblem(Exception):
    """The cache cannot be used as it is; the message names the path and the fix."""


class Stale(Exception):
    """The cached library is missing or does not match what its build recorded; the message says how (empty when
    nothing was ever built there)."""


@dataclass(frozen=True)
class Manifest:
    """What the build recorded about the library it installed."""

    library: str
    size: int
    sha256: str


@dataclass
class _Directory:
    path: str  # where it physically is, for messages
    fd: int
    status: os.stat_result


def _euid() -> int:
    return os.geteuid()


def _exclusive(status: os.stat_result) -> bool:
    """Only root or this user can change what the directory holds."""
    return status.st_uid in (0, _euid()) and not status.st_mode & _OTHERS_WRITE


def _guards(parent: os.stat_result, entry: os.stat_result) -> bool:
    """``parent`` keeps others from replacing ``entry``: it is exclusive, or it is a root-owned sticky directory
    (``/tmp``) and the entry is this user's."""
    sticky = parent.st_uid == 0 and bool(parent.st_mode & stat.S_ISVTX)
    return _exclusive(parent) or (sticky and entry.st_uid == _euid())


def _refusal(target: Path, path: str, status: os.stat_result) -> CacheProblem:
    mode = stat.S_IMODE(status.st_mode)
    if status.st_uid not in (0, _euid()):
        what = f"owned by another user (uid {status.st_uid}, mode {mode:o})"
        fix = _OWN_DIRECTORY
    else:
        what = f"writable by other users (mode {mode:o})"
        fix = (f"Remove their write access (chmod go-w {path}) or point DEVSHIM_CACHE_DIR at a directory of your own"
               " (it is created with mode 0700)." if status.st_uid == _euid() else _OWN_DIRECTORY)
    return CacheProblem(f"devshim will not build or load its emulated device in {target}: {path} is {what}, so a "
                        f"library planted there would run as you. {fix}")


def os_problem(target: Path, path: str, exc: OSError, doing: str) -> CacheProblem:
    """An operating-system error on the cache as one message: what failed, on which path, and what to do."""
    parent = os.path.dirname(path)
    failed = f"devshim cannot {doing} {path} for its emulated device ({target})"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheProblem(f"{failed}: the disk is full ({exc.strerror}). Free space there or point "
                            "DEVSHIM_CACHE_DIR at a disk with room.")
    if exc.errno == errno.EROFS:
        return CacheProblem(f"{failed}: it is on a read-only file system. Point DEVSHIM_CACHE_DIR at a directory "
                            "you can write to.")
    if exc.errno in (errno.EACCES, errno.EPERM) and doing == "create":
        return CacheProblem(f"{failed}: {parent} is read-only for you ({exc.strerror}). Make it writable (chmod u+w "
                            f"{parent}) or point DEVSHIM_CACHE_DIR at a directory you can write to.")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return CacheProblem(f"{failed}: {exc.strerror}. Give yourself access to {parent} or point DEVSHIM_CACHE_DIR "
                            "at a directory of your own.")
    return CacheProblem(f"{failed}: {exc.strerror or exc}. Fix or remove it, or point DEVSHIM_CACHE_DIR at a "
                        "directory of your own.")


def _not_a_directory(target: Path, path: str) -> CacheProblem:
    return CacheProblem(f"devshim cannot keep its emulated device in {target}: {path} is a file, not a directory. "
                        "Remove or move it, or point DEVSHIM_CACHE_DIR at a directory (it is created with mode 0700 "
                        "if missing).")


def _lstat(parent: _Directory, name: str, target: Path, *, create: bool) -> os.stat_result | None:
    """The entry ``name`` of ``parent`` itself (a link is not followed); a missing one is created as a private
    directory when ``create``, else ``None``."""
    path = os.path.join(parent.path, name)
    for _ in range(3):  # another process may create it between our look and our mkdir
        try:
            return os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as exc:
            raise os_problem(target, path, exc, "look at") from None
        try:
            os.mkdir(name, 0o700, dir_fd=parent.fd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise os_problem(target, path, exc, "create") from None
    raise CacheProblem(f"devshim cannot keep its emulated device in {target}: {path} kept changing while devshim "
                       "created it. Check what else writes there, or point DEVSHIM_CACHE_DIR at a directory of your "
                       "own.")


def _open(parent: _Directory, name: str, target: Path) -> _Directory:
    path = os.path.join(parent.path, name)
    try:
        fd = os.open(name, _DIRECTORY, dir_fd=parent.fd)
    except OSError as exc:  # replaced by a link or a file since we looked: someone else writes there
        raise CacheProblem(f"devshim will not build or load its emulated device in {target}: {path} changed while "
                           f"devshim checked it ({exc.strerror}). {_OWN_DIRECTORY}") from None
    return _Directory(path, fd, os.fstat(fd))


def _follow(parent: _Directory, name: str, link: os.stat_result, target: Path) -> str:
    """The target of the link ``name`` in ``parent``, if only root or this user could have put it there."""
    path = os.path.join(parent.path, name)
    pointee = os.readlink(name, dir_fd=parent.fd)
    if not _guards(parent.status, link):
        raise CacheProblem(
            f"devshim will not build or load its emulated device in {target}: {path} is a symbolic link (to "
            f"{pointee}) in {parent.path}, which other users can write to, so it may be theirs or be replaced, and "
            f"devshim does not follow it. Point DEVSHIM_CACHE_DIR at a real directory of your own.")
    return pointee


@contextlib.contextmanager
def directory(root: Path, inside: Sequence[str], target: Path, *, create: bool) -> Iterator[int | None]:
    """The descriptor of ``root/inside...`` (an ``O_PATH`` one where the system has them), every component checked
    as the module says; ``None`` when a component is missing and not ``create``. ``target`` is the directory named
    in messages (the build directory)."""
    top = os.open("/", _DIRECTORY)
    chain = [_Directory("/", top, os.fstat(top))]
    try:
        pending = deque(Path(os.path.abspath(root)).parts[1:])
        links = 0
        while pending:
            name = pending.popleft()
            if name == "..":  # from a link's target: the physical parent
                if len(chain) > 1:
                    os.close(chain.pop().fd)
                continue
            entry = _lstat(chain[-1], name, target, create=create)
            if entry is None:
                yield None
                return
            if stat.S_ISLNK(entry.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    raise CacheProblem(f"devshim cannot keep its emulated device in {target}: {root} goes through "
                                       f"more than {_MAX_LINKS} symbolic links. {_OWN_DIRECTORY}")
                pointee = _follow(chain[-1], name, entry, target)
                if pointee.startswith("/"):
                    while len(chain) > 1:
                        os.close(chain.pop().fd)
                pending.extendleft(reversed([part for part in Path(pointee).parts if part not in ("/", ".")]))
                continue
            if not stat.S_ISDIR(entry.st_mode):
                raise _not_a_directory(target, os.path.join(chain[-1].path, name))
            chain.append(_open(chain[-1], name, target))
        _check_root_and_ancestors(chain, target)
        for name in inside:  # devshim's own directories: real ones, this user's, private
            parent = chain[-1]
            entry = _lstat(parent, name, target, create=create)
            if entry is None:
                yield None
                return
            path = os.path.join(parent.path, name)
            if stat.S_ISLNK(entry.st_mode):
                raise CacheProblem(f"devshim will not build or load its emulated device in {target}: {path} is a "
                                   "symbolic link inside devshim's cache, where devshim makes only directories and "
                                   f"follows no link. Remove it (rm {path}); devshim rebuilds what is missing.")
            if not stat.S_ISDIR(entry.st_mode):
                raise _not_a_directory(target, path)
            opened = _open(parent, name, target)
            chain.append(opened)
            if opened.status.st_uid != _euid() or opened.status.st_mode & _OTHERS_WRITE:
                raise _refusal(target, path, opened.status)
        yield chain[-1].fd
    finally:
        for opened in chain:
            os.close(opened.fd)


def _check_root_and_ancestors(chain: list[_Directory], target: Path) -> None:
    """The cache root (last in ``chain``) is this user's and private enough; so is each directory above it up to
    one that keeps others from replacing what is below."""
    root = chain[-1]
    if root.status.st_uid != _euid() or root.status.st_mode & _OTHERS_WRITE:
        raise _refusal(target, root.path, root.status)
    for parent, child in zip(reversed(chain[:-1]), reversed(chain[1:]), strict=True):
        if _guards(parent.status, child.status):
            return
        raise _refusal(target, parent.path, parent.status)


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, 1 << 20, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def read_manifest(dir_fd: int, library: Path) -> Manifest | None:
    """The manifest beside ``library`` in the directory ``dir_fd``, ``None`` if there is none; :class:`Stale` when
    it cannot be read."""
    shown = library.parent / MANIFEST
    try:
        fd = os.open(MANIFEST, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Stale(f"{library}'s manifest {shown} cannot be read ({exc.strerror})") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != _euid() or status.st_mode & _OTHERS_WRITE:
            raise Stale(f"{library}'s manifest {shown} is not a private file of yours")
        fields = json.loads(os.pread(fd, 1 << 16, 0))
        return Manifest(str(fields["library"]), int(fields["size"]), str(fields["sha256"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise Stale(f"{library}'s manifest {shown} is unreadable ({type(exc).__name__}: {exc})") from None
    finally:
        os.close(fd)


def open_library(dir_fd: int, library: Path) -> int:
    """A read-only descriptor of ``library`` (a file of the directory ``dir_fd``), opened without following a link,
    this user's, writable by no one else, and of the size and sha256 its manifest records, read from this descriptor:
    the file checked is the file the caller loads. :class:`Stale` says why not (empty: nothing was built there)."""
    manifest = read_manifest(dir_fd, library)
    try:
        fd = os.open(library.name, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        raise Stale("" if manifest is None else f"{library} is missing though its manifest records it") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Stale(f"{library} is a symbolic link, not the library devshim built") from None
        raise Stale(f"{library} cannot be opened ({exc.strerror})") from None
    try:
        status = os.fstat(fd)
        if manifest is None:
            raise Stale(f"{library} has no manifest (an older devshim built it, or its build was cut short)")
        if manifest.library != library.name:
            raise Stale(f"{library}'s manifest records {manifest.library} instead")
        if not stat.S_ISREG(status.st_mode):
            raise Stale(f"{library} is not a regular file")
        if status.st_uid != _euid():
            raise Stale(f"{library} belongs to uid {status.st_uid}, not to you")
        if status.st_mode & _OTHERS_WRITE:
            raise Stale(f"{library} is writable by other users (mode {stat.S_IMODE(status.st_mode):o})")
        if status.st_size != manifest.size:
            raise Stale(f"{library} is {status.st_size} bytes where its build recorded {manifest.size} (cut short or "
                        "overwritten)")
        if _sha256(fd) != manifest.sha256:
            raise Stale(f"{library} does not match the sha256 its build recorded (changed since it was built)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_manifest(dir_fd: int, manifest: Manifest) -> None:
    """Written whole under a temporary name, then renamed over the manifest: a reader sees the old one or this."""
    temporary = f".{MANIFEST}.{os.getpid()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        os.write(fd, json.dumps({"library": manifest.library, "size": manifest.size,
                                 "sha256": manifest.sha256}).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temporary, MANIFEST, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def install(dir_fd: int, build: str, library: str, name: str) -> None:
    """Move the library ``library`` built in the subdirectory ``build`` of ``dir_fd`` into ``dir_fd`` as ``name``,
    whole, and record its size and sha256 in the manifest after it. Until the manifest is written a reader finds no
    (or a mismatching) manifest, and waits for the build lock instead of loading."""
    build_fd = os.open(build, _DIRECTORY, dir_fd=dir_fd)
    try:
        fd = os.open(library, _READ, dir_fd=build_fd)
        try:
            os.fchmod(fd, 0o700)  # whatever the umask: a library others could write would fail its own check
            os.fsync(fd)
            manifest = Manifest(name, os.fstat(fd).st_size, _sha256(fd))
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(MANIFEST, dir_fd=dir_fd)  # the old build's: it must not vouch for the new library
        os.rename(library, name, src_dir_fd=build_fd, dst_dir_fd=dir_fd)
        _write_manifest(dir_fd, manifest)
    finally:
        os.close(build_fd)
    sync = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(sync)  # the renames reach the disk before anyone trusts them
    finally:
        os.close(sync)


def entries(dir_fd: int, name: str = ".") -> list[str]:
    """What the directory ``name`` of ``dir_fd`` holds."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove ``name`` in ``dir_fd`` and what it holds, reached through the descriptor (no path is trusted again)."""
    shutil.rmtree(f"/proc/self/fd/{dir_fd}/{name}", ignore_errors=True)
