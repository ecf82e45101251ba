"""The host facts ``devshim info`` adds to its report: what ``ds_report`` and ``accelerate env`` print, and what a
bug report needs.

The operating system, CPUs, memory, ``/dev/shm``, the C and C++ compilers and ninja (what the native builds need),
the emulated device's build cache, the versions of the vendor software under the selected plugin's device (its
``devshim_runtime_versions`` hook), and what became of the job's CUDA/NCCL settings there (:func:`environment`).
Everything is read from files, ``os`` and short ``--version`` calls: nothing here builds, imports a torch extension or
initialises a device.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

OS_RELEASE = Path("/etc/os-release")
MEMINFO = Path("/proc/meminfo")
SHM = Path("/dev/shm")
SHM_ADVISED = 512 << 20  # below this, ds_report warns too: a container's default 64 MiB starves shared-memory work
VERSION_TIMEOUT = 5.0  # seconds a compiler gets to answer --version
RUNTIME_HOOK = "devshim_runtime_versions"


def _key_values(path: Path) -> dict[str, str]:
    """``KEY=value`` lines (shell quoting stripped); empty when the file cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            values[key.strip()] = value.strip().strip("\"'")
    return values


def os_facts(os_release: Path = OS_RELEASE) -> dict[str, str | None]:
    release = _key_values(os_release)
    distro = release.get("PRETTY_NAME") or " ".join(filter(None, (release.get("NAME"), release.get("VERSION"))))
    return {"platform": platform.platform(), "system": platform.system(), "kernel": platform.release(),
            "machine": platform.machine(), "distro": distro or None}


def cpu_facts() -> dict[str, int | None]:
    """The CPUs of the machine, and those this process may run on (a launcher or cgroup may narrow them)."""
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {"count": os.cpu_count(), "usable": usable}


def memory_facts(meminfo: Path = MEMINFO) -> dict[str, int] | None:
    """Total and available memory in bytes, from ``/proc/meminfo`` (``None`` where there is none)."""
    values = {}
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key in ("MemTotal", "MemAvailable") and fields and fields[0].isdigit():
            scale = 1024 if fields[1:2] == ["kB"] else 1
            values["total" if key == "MemTotal" else "available"] = int(fields[0]) * scale
    return values if "total" in values else None


def shm_facts(path: Path = SHM) -> dict[str, Any]:
    """Size and free space of ``/dev/shm`` in bytes, or ``absent``."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return {"path": str(path), "absent": True}
    size = stats.f_frsize * stats.f_blocks
    return {"path": str(path), "absent": False, "size": size, "free": stats.f_frsize * stats.f_bavail,
            "small": size < SHM_ADVISED}


def _first_line_of_version(path: str) -> str:
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"did not answer --version within {VERSION_TIMEOUT:g} s"
    except OSError as exc:
        return f"--version failed: {exc}"
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[0].strip() if lines else f"--version printed nothing (exit status {result.returncode})"


def compiler_facts(variable: str, names: tuple[str, ...]) -> dict[str, str] | None:
    """The first compiler found on PATH: ``$variable`` (as the builds read it), then ``names``; with the first line
    of its ``--version``."""
    candidates = []
    configured = os.environ.get(variable, "").strip()
    if configured:
        with contextlib.suppress(ValueError, IndexError):  # an unbalanced quote, or only spaces
            candidates.append(shlex.split(configured)[0])
    candidates.extend(names)
    for name in candidates:
        path = shutil.which(name)
        if path:
            return {"name": name, "path": path, "version": _first_line_of_version(path)}
    return None


def ninja_facts() -> dict[str, Any]:
    """ninja as a binary on PATH, or as the ``ninja`` Python package (torch's extension builds take either)."""
    binary = shutil.which("ninja")
    package = None
    if importlib.util.find_spec("ninja") is not None:
        try:
            package = importlib.metadata.version("ninja")
        except importlib.metadata.PackageNotFoundError:
            package = "unknown version"
    return {"available": bool(binary or package), "binary": binary, "python_package": package}


def emulator_facts() -> dict[str, Any]:
    """Where the emulated device is built, and whether it is: built, building (another process holds the build
    lock) or missing (the first ``DEVSHIM_EMULATE`` run builds it); ``not installed`` without devshim-emulation."""
    from devshim_core import emulator

    return emulator.cache_state()


def runtime_versions(registry: Any, record: Any) -> dict[str, Any]:
    """The selected plugin's answer to ``devshim_runtime_versions``, checked: ``versions`` is a ``{str: str}`` dict
    (empty when the plugin reads none); a hook that raises or answers anything else is reported in ``error``."""
    facts: dict[str, Any] = {"plugin": record.name, "versions": {}, "error": None}
    try:
        answer = registry.call(record, RUNTIME_HOOK, report=record.report)
    except BaseException as exc:  # as in detection: a plugin's bug, or its sys.exit(), must not end the report
        if isinstance(exc, KeyboardInterrupt):
            raise
        facts["error"] = f"{RUNTIME_HOOK} raised {type(exc).__name__}: {exc}"
        return facts
    if answer is None:
        return facts
    if not isinstance(answer, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in answer.items()):
        facts["error"] = (f"{RUNTIME_HOOK} returned {type(answer).__name__} ({answer!r:.80}); it must return a dict "
                          "of str to str, or None")
        return facts
    facts["versions"] = dict(answer)
    return facts


def environment(session: Any) -> dict[str, Any] | None:
    """What became of the job's CUDA/NCCL settings on the selected plugin's device (``None`` when the plugin declares
    no mapping, as on CUDA): each translation, kept vendor variable, untranslatable or ignored setting."""
    migration = getattr(session, "environment", None)
    return None if migration is None else migration.as_dict()


def collect(session: Any = None) -> dict[str, Any]:
    """Every host fact; ``runtime`` is the selected plugin's (``None`` when no plugin was selected)."""
    return {
        "os": os_facts(),
        "cpus": cpu_facts(),
        "memory": memory_facts(),
        "shm": shm_facts(),
        "c_compiler": compiler_facts("CC", ("cc", "gcc", "clang")),
        "cxx_compiler": compiler_facts("CXX", ("c++", "g++", "clang++")),
        "ninja": ninja_facts(),
        "emulator": emulator_facts(),
        "runtime": runtime_versions(session.registry, session.selection.plugin) if session is not None else None,
    }
