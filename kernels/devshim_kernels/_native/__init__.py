"""The ahead-of-time compiled host Adam kernel (``adam.c``), found next to this file and loaded with ctypes.

ctypes releases the GIL for the length of each call. Nothing here compiles anything: if the library was not
built at install time (no compiler), ``LIBRARY`` is ``None`` and ``REASON`` says why.

Threads: when torch runs its own parallel regions on OpenMP, the kernel borrows torch's thread team through
the ``GOMP_parallel`` entry point of the OpenMP runtime torch has already loaded. It never loads a runtime of its
own (a second runtime, or threads of our own, would compete with torch's workers, which spin for a while after
each torch op: measured 20% slower right after one). Otherwise it starts pthreads.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import pathlib
from array import array

NATIVE_SWITCH = "DEVSHIM_KERNELS_NATIVE"  # "0": always PyTorch; "generic": the host Adam's portable C loop
OFF_VALUES = ("0", "false", "no", "off", "torch")
ABI_VERSION = 1  # must equal DEVSHIM_ADAM_ABI in adam.c: a stale library from an older build is not used
ISA_GENERIC, ISA_AVX2 = 0, 1
ISA_NAMES = {ISA_GENERIC: "generic C", ISA_AVX2: "avx2+fma+f16c"}
DT_F32, DT_BF16, DT_F16, DT_NONE = 0, 1, 2, 3
FIELDS = 10  # int64 fields of adam.c's adam_tensor: numel, 6 addresses, 3 dtype codes


def switched_off() -> bool:
    """Whether ``DEVSHIM_KERNELS_NATIVE`` turns the native kernels off (read at each call: tests flip it)."""
    return os.environ.get(NATIVE_SWITCH, "").strip().lower() in OFF_VALUES


def library_path(stem: str) -> pathlib.Path | None:
    """Where the native library ``stem`` (``_adam``, ``_rowwise``, ``_aio``) was built, or ``None``."""
    spec = importlib.util.find_spec(f"{__name__}.{stem}")  # also resolves editable installs
    if spec is not None and spec.origin:
        return pathlib.Path(spec.origin)
    here = pathlib.Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (here / f"{stem}{suffix}").exists():
            return here / f"{stem}{suffix}"
    return None


def open_library(stem: str, abi_symbol: str, abi_version: int, what: str) -> tuple[ctypes.CDLL | None, str]:
    """Load the native library ``stem`` and check its ABI version (what ``abi_symbol()`` returns): the library,
    or ``None`` and why it cannot be used (not built, not loadable, not ours, or from an older build)."""
    path = library_path(stem)
    if path is None:
        return None, f"{what} was not built: no {stem} library in devshim_kernels/_native (no C compiler?)"
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        return None, f"{what} {path.name} failed to load: {error}"
    try:
        abi = getattr(library, abi_symbol)()
    except AttributeError:
        return None, f"{path.name} is not {what}: it has no {abi_symbol}"
    if abi != abi_version:
        return None, f"{what} is stale (ABI {abi}, expected {abi_version}): reinstall devshim-kernels"
    return library, ""


def _load() -> tuple[ctypes.CDLL | None, str]:
    library, reason = open_library("_adam", "devshim_adam_abi_version", ABI_VERSION, "devshim's native Adam kernel")
    if library is None:
        return None, reason
    library.devshim_adam_set_openmp.argtypes = [ctypes.c_void_p]
    library.devshim_adam_set_openmp.restype = None
    library.devshim_adam_step.restype = ctypes.c_int
    library.devshim_adam_step.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_double] * 7, ctypes.c_int,
                                          ctypes.c_int, ctypes.c_int]
    return library, ""


LIBRARY, REASON = _load()
BEST_ISA: int = LIBRARY.devshim_adam_best_isa() if LIBRARY is not None else ISA_GENERIC
HAS_THREADS: bool = bool(LIBRARY.devshim_adam_has_threads()) if LIBRARY is not None else False  # pthreads


_OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp5")  # GNU, LLVM and Intel runtimes all have GOMP_parallel
_threads: str | None = None  # how the kernel runs threads, once chosen: "torch's OpenMP threads" or "pthreads"


def _loaded_openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process, torch's own first (Linux; elsewhere none)."""
    import torch

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line}
    except OSError:
        return []
    runtimes = [p for p in paths if os.path.basename(p).startswith(_OPENMP_RUNTIMES)]
    torch_lib = str(pathlib.Path(torch.__file__).parent / "lib")
    return sorted(runtimes, key=lambda p: (not p.startswith(torch_lib), p))


def torch_openmp_entry() -> int | None:
    """The address of ``GOMP_parallel`` in the OpenMP runtime torch uses, or ``None`` (torch not on OpenMP)."""
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    handles = []
    for path in _loaded_openmp_runtimes():
        try:  # RTLD_NOLOAD: a handle on the runtime already in the process, never a new one
            handles.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except (OSError, AttributeError):
            continue
    if os.name == "posix":
        handles.append(ctypes.CDLL(None))  # the global namespace (macOS, or a runtime loaded RTLD_GLOBAL)
    for handle in handles:
        try:
            return ctypes.cast(handle.GOMP_parallel, ctypes.c_void_p).value
        except AttributeError:
            continue
    return None


def use_threads(kind: str = "auto") -> str:
    """Choose how the kernel runs threads: ``"openmp"`` (torch's team, if there is one), ``"pthreads"``, or
    ``"auto"`` (the first). Returns the choice made; the first update makes it if nobody has."""
    global _threads
    assert LIBRARY is not None
    entry = torch_openmp_entry() if kind in ("auto", "openmp") else None
    LIBRARY.devshim_adam_set_openmp(entry)
    _threads = "torch's OpenMP threads" if entry else "pthreads" if HAS_THREADS else "no threads"
    return _threads


def threads() -> str:
    return _threads if _threads is not None else use_threads()


def step(table: array, count: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
         bias_correction1: float, bias_correction2: float, adamw_mode: bool, num_threads: int, isa: int) -> None:
    """Run ``devshim_adam_step`` over ``count`` tensors described by ``table`` (``FIELDS`` int64s each)."""
    assert LIBRARY is not None and len(table) == count * FIELDS
    if _threads is None:
        use_threads()
    address, _ = table.buffer_info()
    status = LIBRARY.devshim_adam_step(address, count, lr, beta1, beta2, eps, weight_decay, bias_correction1,
                                       bias_correction2, int(adamw_mode), num_threads, isa)
    if status != 0:
        raise RuntimeError(f"devshim native Adam kernel rejected its arguments (status {status})")
