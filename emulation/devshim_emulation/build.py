"""Build the emulated device's C++ source once per machine, torch version and source hash; load it after that.

Only emulation asks for it. The build goes to ``$DEVSHIM_CACHE_DIR`` (default ``~/.cache/devshim``), never to
``TORCH_EXTENSIONS_DIR``, under a file lock so that the ranks of a job starting together build it once between
them. It compiles in a fresh private directory beside its destination (so no stale lock file of torch's from a killed
build can exist there), and the library is renamed into place whole, then recorded (size, sha256) in a manifest. A
load checks the cache's path and the library against that record through file descriptors (``cache_files``) and
imports the very file it checked; a library that does not match is rebuilt, saying so.

The first build says so on stderr (what it builds, where, that it takes about a minute once) and how long it took; a
process that finds another one building says which process it waits for, and waits at most :data:`WAIT_LIMIT_S`.
``devshim info`` reads :func:`build_state`, which neither builds nor waits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import secrets
import shutil
import socket
import stat
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from devshim_core.errors import ConfigError
from devshim_emulation import cache_files

SOURCE = Path(__file__).with_name("csrc") / "emulated_device.cpp"
WAIT_LIMIT_S = 600.0  # for another process's build: ~9x the 67 s a build takes on 2 cores
_LOCK = ".lock"
_UNFINISHED = ".build-"  # prefix of the private directory each build compiles in: .build-<pid>-<random>
_loaded: ModuleType | None = None
_loading = threading.Lock()  # two threads of a process must not import the library twice
_held: list[int] = []  # descriptors of imported libraries: kept open, so that their /proc/self/fd name stays theirs


class EmulationBuildError(ConfigError):
    """The emulated device cannot be built here; the message says what is missing."""


def cache_root() -> Path:
    configured = os.environ.get("DEVSHIM_CACHE_DIR", "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "devshim"


def build_key() -> str:
    """What the binary depends on: the source, the torch build and the C++ ABI it was compiled with."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{sysconfig.get_config_var('SOABI')}".encode())
    return digest.hexdigest()[:16]


def module_name() -> str:
    return f"devshim_emulated_device_{build_key()}"


def build_directory() -> Path:
    return cache_root() / "emulation" / f"torch-{torch.__version__}" / build_key()


def missing_build_tools() -> list[str]:
    """What a build needs and this machine lacks, each with how to get it."""
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler!r} is not on PATH: install g++, e.g. `apt-get install g++`, "
                       "or set CXX)")
    include = sysconfig.get_paths().get("include", "")
    if not (Path(include) / "Python.h").exists():
        missing.append(f"the Python headers ({include}/Python.h is missing: install python3-dev)")
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
        missing.append("ninja (pip install ninja)")
    return missing


def _say(message: str) -> None:
    """An event the user must see (a build of minutes), through devshim's logger: on stderr by default."""
    from devshim_core import log

    log.logger("emulation").info(message)


def _what() -> str:
    """The device being built, as the user asked for it: ``DEVSHIM_EMULATE``'s vendor and its device type."""
    from devshim_emulation.errors import EmulationError
    from devshim_emulation.sdks import VENDORS, requested_vendor

    try:
        vendor = requested_vendor()
    except EmulationError:
        vendor = None
    if vendor is None:  # a plugin author's own enable_device(), or a test
        return "devshim's emulated device"
    return f"devshim's emulated {VENDORS[vendor]} device for {vendor} (DEVSHIM_EMULATE={vendor})"


def _built_library(directory: Path, name: str) -> Path | None:
    candidates = sorted(directory.glob(f"{name}*.so"))
    return candidates[0] if candidates else None


def build_state() -> tuple[str, Path, Path | None]:
    """``(state, build directory, library)`` for this source and torch on this machine, found without building,
    importing or waiting: ``built`` (the library is there), ``building`` (a process holds the build lock) or
    ``missing`` (the first ``DEVSHIM_EMULATE`` run builds it)."""
    directory = build_directory()
    library = _built_library(directory, module_name())
    if library is not None:
        return "built", directory, library
    try:
        fd = os.open(directory / _LOCK, os.O_RDONLY)
    except OSError:  # no build directory or no lock: nothing was ever started here
        return "missing", directory, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return "building", directory, None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return "missing", directory, None


def _require_build_tools() -> None:
    missing = missing_build_tools()
    if missing:
        raise EmulationBuildError("devshim's device emulation compiles a small C++ extension once per machine, and "
                                  f"this machine lacks: {'; '.join(missing)}. Nothing was built; emulation stays off.")


def _compile(directory: Path, name: str) -> None:
    """Compile the source into ``directory``, a fresh private directory: torch's own build lock there (a file that a
    killed build leaves behind, and that torch would wait on forever) can never be a stale one. The library is not
    imported here: :func:`_import_library` imports it from the cache after checking it."""
    from torch.utils import cpp_extension

    # torch skips a build it thinks it did in this process already (a retry after a failed or damaged one)
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
    env_before = os.environ.get("MAX_JOBS")
    os.environ.setdefault("MAX_JOBS", "2")
    try:
        cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(directory), extra_cflags=["-O1"],
                           is_python_module=False, verbose=False)
    finally:
        if env_before is None:
            os.environ.pop("MAX_JOBS", None)


def _disk_full(exc: BaseException) -> str | None:
    """What says that a build failed for want of space: an OSError's text, or the line of the compiler's or linker's
    output that says so (torch reports those as a RuntimeError); ``None`` for any other failure."""
    if isinstance(exc, OSError):
        return str(exc) if exc.errno in (errno.ENOSPC, errno.EDQUOT) else None
    signs = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
    return next((line.strip() for line in str(exc).splitlines() if any(sign in line for sign in signs)), None)


def _build(dir_fd: int, directory: Path, name: str) -> None:
    """Compile in a private directory under ``directory`` and install the library whole, saying before what is built,
    where, and that it takes about a minute once; and after, how long it took."""
    what = _what()
    for entry in cache_files.entries(dir_fd):  # we hold the lock, so their builders are gone
        if entry.startswith(_UNFINISHED):
            pid = entry[len(_UNFINISHED):].split("-")[0]
            _say(f"removing the unfinished build that process {pid} left in {directory / entry} (it ended before "
                 "finishing: killed, or out of memory)")
            cache_files.remove_tree(dir_fd, entry)
    _say(f"building {what} into {directory}: a C++ extension compiled once per machine and torch version, which "
         "takes about a minute on 2 cores; later runs load it")
    started = time.monotonic()
    private = f"{_UNFINISHED}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(private, 0o700, dir_fd=dir_fd)
        try:
            _compile(directory / private, name)
            built = sorted(entry for entry in cache_files.entries(dir_fd, private)
                           if entry.startswith(name) and entry.endswith(".so"))
            if not built:
                raise EmulationBuildError(f"building devshim's emulated device in {directory} produced no {name}*.so")
            cache_files.install(dir_fd, private, built[0], f"{name}.so")
        finally:
            cache_files.remove_tree(dir_fd, private)
    except EmulationBuildError:
        raise
    except Exception as exc:
        full = _disk_full(exc)
        if full:
            raise EmulationBuildError(
                f"building {what} in {directory} failed: the disk is full ({full}). Free space on the file system of "
                f"{cache_root()} (a build needs about 2 MB) or point DEVSHIM_CACHE_DIR at a disk with room; nothing "
                "was installed, and the next run builds again.") from exc
        raise EmulationBuildError(f"building devshim's emulated device failed in {directory}: {exc}") from exc
    _say(f"built {what} in {time.monotonic() - started:.0f} s")


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} minutes" if seconds >= 120 else f"{seconds:g} s"


def _holder(fd: int) -> str:
    """Who holds the build lock, as its holder recorded it: ``process 123 on host h``."""
    recorded = os.pread(fd, 200, 0).decode(errors="replace").split()
    return f"process {recorded[0]} on host {recorded[1]}" if len(recorded) == 2 else "another process"


@contextlib.contextmanager
def _locked(dir_fd: int, directory: Path) -> Iterator[None]:
    """The build lock of ``directory`` (an fcntl lock: it dies with its holder, so it is never stale), holding this
    process's pid and host for whoever waits; waiting at most :data:`WAIT_LIMIT_S`."""
    try:
        fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise cache_files.os_problem(directory, str(directory / _LOCK), exc, "create") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EmulationBuildError(f"{directory / _LOCK} is not a file: remove it; devshim makes it again.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process (a rank of the same job, say) is building it
            holder = _holder(fd)
            _say(f"waiting for {holder} that is building {_what()} in {directory} (about a minute, once; devshim "
                 f"waits up to {_duration(WAIT_LIMIT_S)})")
            deadline = time.monotonic() + WAIT_LIMIT_S
            while True:
                time.sleep(0.2)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        holder = _holder(fd)
                        pid = holder.split()[1] if holder.startswith("process ") else "PID"
                        raise EmulationBuildError(
                            f"devshim waited {_duration(WAIT_LIMIT_S)} for {holder} to finish building {_what()} in "
                            f"{directory}, and it still holds {directory / _LOCK}. If that process is stuck, end it "
                            f"(kill {pid}) and run again: its lock goes with it, and the next run builds.") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _why_build(dir_fd: int | None, library: Path) -> str | None:
    """``None`` when the cache holds ``library`` as its build recorded it; else why it must be built ("" when
    nothing was built there yet)."""
    if dir_fd is None:
        return ""
    try:
        fd = cache_files.open_library(dir_fd, library)
    except cache_files.Stale as stale:
        return str(stale)
    os.close(fd)
    return None


def _import_library(library: Path, name: str) -> ModuleType:
    """Import the cached ``library`` from the descriptor its check read (``/proc/self/fd/N``): a file swapped in
    after the check is never the one loaded."""
    root = cache_root()
    with cache_files.directory(root, library.parent.relative_to(root).parts, library.parent, create=False) as dir_fd:
        if dir_fd is None:
            raise EmulationBuildError(f"{library.parent} disappeared while devshim loaded {library}: run again.")
        try:
            fd = cache_files.open_library(dir_fd, library)
        except cache_files.Stale as stale:
            raise EmulationBuildError(f"{library} changed between devshim's check and its load ("
                                      f"{stale or 'it is gone'}): something else writes to {library.parent}. Run "
                                      "again.") from None
    try:
        path = f"/proc/self/fd/{fd}"
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except BaseException:
        os.close(fd)
        raise
    module.__file__ = str(library)  # where it lives, rather than the descriptor it was read through
    _held.append(fd)
    return module


def load_extension() -> ModuleType:
    """The compiled emulator, built first if this machine has no build of this source for this torch, or one that
    does not match what its build recorded."""
    global _loaded
    if _loaded is not None:  # every collective asks (device.host_alias): no lock once loaded
        return _loaded
    with _loading:
        if _loaded is None:
            try:
                _loaded = _load()
            except cache_files.CacheProblem as problem:
                raise EmulationBuildError(str(problem)) from None
            except OSError as exc:  # anything else the file system refuses (a lock, a full disk): still one message
                path = str(exc.filename or build_directory())
                raise EmulationBuildError(str(cache_files.os_problem(build_directory(), path, exc, "use"))) from exc
        return _loaded


def _load() -> ModuleType:
    name, root, directory = module_name(), cache_root(), build_directory()
    inside = directory.relative_to(root).parts
    library = directory / f"{name}.so"
    with cache_files.directory(root, inside, directory, create=False) as dir_fd:
        why = _why_build(dir_fd, library)
    if why is not None:
        _require_build_tools()  # before the build directory and its lock exist: a refused build leaves nothing
        with cache_files.directory(root, inside, directory, create=True) as dir_fd:
            assert dir_fd is not None
            with _locked(dir_fd, directory):
                why = _why_build(dir_fd, library)  # another process may have built it while we waited
                if why is not None:
                    if why:
                        _say(f"the cached emulator library {why}: rebuilding it")
                    _build(dir_fd, directory, name)
    return _import_library(library, name)
