"""Build the emulated device's C++ source once per machine, torch version and source hash; load it after that.

Only emulation asks for it. The build goes to ``$DEVSHIM_CACHE_DIR`` (default ``~/.cache/devshim``), never to
``TORCH_EXTENSIONS_DIR``, and is guarded by a file lock so that the ranks of a job starting together build
it once between them. Directories devshim creates there are private (mode 0700), and nothing is built in or
loaded from a directory another user owns or can write to: a library planted there would run as this user.

The first build says so on stderr (what it builds, where, that it takes about a minute once) and how long it took; a
process that finds another one building says that it waits. ``devshim info`` reads :func:`build_state`, which
neither builds nor waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import stat
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from devshim_core.errors import ConfigError

SOURCE = Path(__file__).with_name("csrc") / "emulated_device.cpp"
_loaded: ModuleType | None = None


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


def _private(directory: Path) -> None:
    """Create ``directory`` (mode 0700 for what is created) and check that this user alone can write to it and
    to each directory from the cache root down."""
    root = cache_root()
    missing = [path for path in (directory, *directory.parents) if not path.exists()]
    for path in reversed(missing):  # mkdir(parents=True) would give the parents the default mode
        path.mkdir(mode=0o700, exist_ok=True)
    for path in (directory, *directory.parents):
        status = path.stat()
        if status.st_uid != os.getuid() or status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise EmulationBuildError(
                f"devshim will not build or load its emulated device in {directory}: {path} is "
                f"{'owned by another user' if status.st_uid != os.getuid() else 'writable by other users'} "
                f"(mode {stat.S_IMODE(status.st_mode):o}), so a library planted there would run as you. Point "
                "DEVSHIM_CACHE_DIR at a directory of your own (it is created with mode 0700).")
        if path == root:
            break


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


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    _private(directory)
    with open(directory / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process (a rank of the same job, say) is building it
            _say(f"waiting for another process that is building {_what()} in {directory} (about a minute, once)")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
        fd = os.open(directory / ".lock", os.O_RDONLY)
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


def _import_library(path: Path, name: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _require_build_tools() -> None:
    missing = missing_build_tools()
    if missing:
        raise EmulationBuildError("devshim's device emulation compiles a small C++ extension once per machine, and "
                                  f"this machine lacks: {'; '.join(missing)}. Nothing was built; emulation stays off.")


def _compile(directory: Path, name: str) -> None:
    from torch.utils.cpp_extension import load

    env_before = os.environ.get("MAX_JOBS")
    os.environ.setdefault("MAX_JOBS", "2")
    try:
        load(name=name, sources=[str(SOURCE)], build_directory=str(directory), extra_cflags=["-O1"],
             is_python_module=True, verbose=False)
    except Exception as exc:  # a compiler error: say where the log is
        raise EmulationBuildError(f"building devshim's emulated device failed in {directory}: {exc}") from exc
    finally:
        if env_before is None:
            os.environ.pop("MAX_JOBS", None)


def _build(directory: Path, name: str) -> None:
    """Compile, saying before what is built, where, and that it takes about a minute once; and after, how long it
    took."""
    what = _what()
    _say(f"building {what} into {directory}: a C++ extension compiled once per machine and torch version, which "
         "takes about a minute on 2 cores; later runs load it")
    started = time.monotonic()
    _compile(directory, name)
    _say(f"built {what} in {time.monotonic() - started:.0f} s")


def load_extension() -> ModuleType:
    """The compiled emulator, built first if this machine has no build of this source for this torch."""
    global _loaded
    if _loaded is not None:
        return _loaded
    name, directory = module_name(), build_directory()
    if directory.exists():
        _private(directory)
    library = _built_library(directory, name)
    if library is None:
        _require_build_tools()  # before the build directory and its lock exist: a refused build leaves nothing
        with _locked(directory):
            library = _built_library(directory, name)
            if library is None:
                _build(directory, name)
                library = _built_library(directory, name)
    if library is None:
        raise EmulationBuildError(f"the emulated device was built in {directory} but no {name}*.so is there")
    _loaded = _import_library(library, name)
    return _loaded
