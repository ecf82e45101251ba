"""Detection of CUDA (or ROCm/HIP) devices, and what the machine says about them, without initialising CUDA.

Detection runs at a training script's first line (``import devshim_core.auto``, or inside its first ``import torch``
with ``DEVSHIM_AUTO=1``), before the script sets ``CUDA_VISIBLE_DEVICES`` or forks its workers, so it must leave CUDA
untouched: once the CUDA driver is initialised (``cuInit``) the visible devices are fixed for the process, and a
forked child that uses CUDA stops with "Cannot re-initialize CUDA in forked subprocess".

Devices are counted the way torch counts them without initialising anything: through NVML on a CUDA build
(``torch.cuda._device_count_nvml()``: the driver's ``libnvidia-ml.so.1`` loaded with ctypes, honouring
``CUDA_VISIBLE_DEVICES`` given as indices or GPU UUIDs) and through amdsmi on a ROCm build
(``torch.cuda._device_count_amdsmi()``, when torch could import the ``amdsmi`` package). Neither calls into the CUDA
or HIP runtime: no ``cuInit``/``hipInit``, no context, no caching allocator, and ``torch.cuda.is_initialized()``
stays False. ``torch.cuda.is_available()`` is never called (it calls ``cudaGetDeviceCount``, which runs ``cuInit``).

Only where that path cannot count (no NVML library, NVML failing to initialise, MIG devices named in
``CUDA_VISIBLE_DEVICES``, no amdsmi on ROCm, or a torch without those private functions) does detection fall back to
``torch.cuda.device_count()``, which asks the runtime: that initialises the driver (not a context) and poisons fork;
the report's reason then says so. A process that has already initialised CUDA is counted by the runtime, which costs
nothing more. Device names, the driver version and the reasons a device is missing are read from ``/proc`` and
``/sys``, never from the runtime.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from devshim_cuda import nvml

# where the NVIDIA kernel module describes itself and each GPU; the AMD one, its driver and kernel interface
NVIDIA_PROC = Path("/proc/driver/nvidia")
AMDGPU_MODULE = Path("/sys/module/amdgpu")
AMD_KFD = Path("/dev/kfd")

CUDA_VISIBLE = ("CUDA_VISIBLE_DEVICES",)
# ROCm's torch honours all three; HIP's own variable first, as the launchers set it
HIP_VISIBLE = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


class Found(NamedTuple):  # not a dataclass: this module loads on every start
    ok: bool
    reason: str
    device_count: int = 0


def hip_version() -> str | None:
    """torch's HIP (ROCm) version, or ``None`` for a CUDA or CPU-only build."""
    return getattr(torch.version, "hip", None) or None


def cuda_version() -> str | None:
    """torch's CUDA runtime version, or ``None`` for a ROCm or CPU-only build."""
    return getattr(torch.version, "cuda", None) or None


def runtime_name() -> str | None:
    """``"CUDA 12.4"``, ``"ROCm (HIP 6.2.41133)"``, or ``None`` for a CPU-only build of torch."""
    hip = hip_version()
    if hip:
        return f"ROCm (HIP {hip})"
    cuda = cuda_version()
    return f"CUDA {cuda}" if cuda else None


def visible_devices_envs() -> tuple[str, ...]:
    """The variables that restrict which devices this process sees, the canonical one first."""
    return HIP_VISIBLE if hip_version() else CUDA_VISIBLE


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA kernel module's version (``550.54.14``), from ``/proc/driver/nvidia/version``."""
    try:
        first = (NVIDIA_PROC / "version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    found = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)*)\s", first + " ")
    return found.group(1) if found else None


def amdgpu_driver_version() -> str | None:
    """The amdgpu kernel module's version where the module says it (DKMS builds do, in-tree ones do not)."""
    try:
        return (AMDGPU_MODULE / "version").read_text().strip() or None
    except OSError:
        return None


def nvidia_models() -> list[str]:
    """The model of each GPU the NVIDIA driver knows (all of them, whatever this process may see)."""
    models = []
    for info in sorted((NVIDIA_PROC / "gpus").glob("*/information")):
        try:
            text = info.read_text()
        except OSError:
            continue
        found = re.search(r"^Model:\s*(.+?)\s*$", text, re.MULTILINE)
        if found:
            models.append(found.group(1))
    return models


def describe_devices(count: int) -> str:
    """``8 x NVIDIA H100 80GB HBM3`` when the driver names one model; ``2 devices (A, B on this machine)`` for
    several; ``8 devices`` when it names none (ROCm, or /proc unreadable)."""
    models = sorted(set(nvidia_models())) if not hip_version() else []
    if len(models) == 1:
        return f"{count} x {models[0]}"
    plural = "device" if count == 1 else "devices"
    if models:
        return f"{count} {plural} ({', '.join(models)} on this machine)"
    return f"{count} {plural}"


def _why_none(runtime: str, warned: str, counter: str) -> str:
    """Why ``counter`` (NVML, amdsmi or the runtime) counts no device, and what to do: a visible-devices variable, a
    missing or old driver."""
    for name in visible_devices_envs():
        value = os.environ.get(name)
        if value is not None and value.strip() in ("", "-1", "none", "NoDevFiles"):
            return f"{name}={value!r}: it hides every device from this process; unset it or list device indices"
    hidden = next((f"{name}={os.environ[name]!r}" for name in visible_devices_envs() if name in os.environ), None)
    where = f"; {hidden} may name devices that do not exist" if hidden else ""
    if warned:
        return f"torch warned: {warned}{where}"
    if hip_version():
        if not AMD_KFD.exists():
            return f"no AMD GPU driver: {AMD_KFD} is absent; install the amdgpu driver and check rocm-smi{where}"
        return (f"{AMD_KFD} exists but {counter} finds no GPU: check rocm-smi and that this user may open "
                f"{AMD_KFD}{where}")
    driver = nvidia_driver_version()
    if driver is None:
        return (f"no NVIDIA driver is loaded ({NVIDIA_PROC / 'version'} is absent): install the driver and check "
                f"nvidia-smi; in a container, start it with the GPUs (e.g. docker run --gpus all){where}")
    return (f"NVIDIA driver {driver} is loaded but {counter} finds no GPU: check nvidia-smi, and that the "
            f"driver supports {runtime}{where}")


# whether this process's detection had to count through the runtime (which initialised the driver): the traits then
# ask torch too, since that adds nothing the count has not already done (see devshim_cuda.traits)
_runtime_counted = False


def runtime_counted() -> bool:
    """Whether detection counted through the CUDA/HIP runtime, initialising its driver, in this process."""
    return _runtime_counted


def _management_library() -> str:
    return "amdsmi" if hip_version() else "NVML"


def _management_warning(message: str) -> bool:
    """torch's own warnings from its NVML/amdsmi count ("Can't initialize NVML", "Cannot get amd device handler"),
    not the runtime's (which begin "CUDA initialization:")."""
    return message.startswith(("Can't ", "Cannot "))


def _count_without_init() -> tuple[int | None, str]:
    """The device count through NVML (amdsmi on ROCm), as torch counts it without initialising anything, honouring
    the visible-devices variables; ``(None, why and what to do)`` where that path is missing or fails."""
    rocm = bool(hip_version())
    function = "_device_count_amdsmi" if rocm else "_device_count_nvml"
    install = ("install amdsmi (ROCm's amd-smi Python package) to avoid it" if rocm else
               "install NVML (the driver's libnvidia-ml) to avoid it")
    counter = getattr(torch.cuda, function, None)
    if counter is None:
        return None, f"this torch has no torch.cuda.{function}; a newer torch avoids it"
    with warnings.catch_warnings(record=True) as caught:  # torch warns "Can't initialize NVML" on failure
        warnings.simplefilter("always")
        try:
            count = int(counter())
        except Exception as exc:  # e.g. ROCm's check that HIP_VISIBLE_DEVICES fits in ROCR_VISIBLE_DEVICES
            return None, f"{type(exc).__name__}: {exc}"
    if count >= 0:
        return count, ""
    if caught:  # the library loaded but failed: its own tool says why
        said = " ".join(str(caught[0].message).split())[:200]
        return None, f"{said}; {'amd-smi' if rocm else 'nvidia-smi'} shows why"
    if rocm:
        return None, f"torch could not import the amdsmi package; {install}"
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip().startswith("MIG-"):
        return None, "CUDA_VISIBLE_DEVICES names MIG devices, which torch's NVML count does not resolve"
    return None, f"{nvml.LIBRARY} could not be loaded; {install}"


def _runtime_note(kind: str, why: str) -> str:
    return (f"counted by the {kind} runtime: this initialised the driver, as {_management_library()} could not "
            f"count: {why}")


def detect() -> Found:
    global _runtime_counted
    runtime = runtime_name()
    if runtime is None:
        return Found(False, f"torch {torch.__version__} is a CPU-only build: no CUDA runtime (install a CUDA or ROCm "
                            "build of torch to use an NVIDIA or AMD GPU)")
    kind = "HIP" if hip_version() else "CUDA"
    count: int | None = None
    if torch.cuda.is_initialized():  # the runtime is up already: counting through it initialises nothing more
        counter = f"the {kind} runtime"
        note = f"counted by the {kind} runtime, which this process had already initialised"
    else:
        count, why = _count_without_init()
        if count is not None:
            counter, note = _management_library(), f"counted through {_management_library()}, {kind} not initialised"
        else:
            counter, note = f"the {kind} runtime", _runtime_note(kind, why)
            _runtime_counted = True
    warned = ""
    if count is None:
        with warnings.catch_warnings(record=True) as caught:  # e.g. "the NVIDIA driver on your system is too old"
            warnings.simplefilter("always")
            try:
                count = int(torch.cuda.device_count())
            except (RuntimeError, AssertionError, OSError) as exc:
                return Found(False, f"{runtime} runtime, but asking it for devices failed: {type(exc).__name__}: "
                                    f"{exc}; check the driver (nvidia-smi or rocm-smi)")
        # torch.cuda.device_count() tries NVML/amdsmi again first: its warnings about that are not the runtime's
        messages = [str(w.message) for w in caught if not _management_warning(str(w.message))]
        warned = " ".join(messages[0].split())[:300] if messages else ""
    if count < 1:
        return Found(False, f"{runtime} runtime, 0 devices visible ({_why_none(runtime, warned, counter)})")
    return Found(True, f"{runtime}, {describe_devices(count)} ({note})", count)
