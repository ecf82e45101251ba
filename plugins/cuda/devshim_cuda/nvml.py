"""What NVML (the NVIDIA driver's management library, ``libnvidia-ml.so.1``) says about each GPU, read through ctypes.

NVML talks to the kernel driver and never to the CUDA driver API: reading it does not call ``cuInit``, create a
context, or stop a forked child from using CUDA, and ``CUDA_VISIBLE_DEVICES`` set later still applies. torch counts
devices through the same library (``torch.cuda._device_count_nvml``) for the same reason. No Python binding is needed
(``pynvml`` is not a dependency); where the library or a symbol is missing, :func:`gpus` answers ``None``.
"""

from __future__ import annotations

from typing import NamedTuple

LIBRARY = "libnvidia-ml.so.1"
BUFFER = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE and NVML_DEVICE_UUID_V2_BUFFER_SIZE
SUCCESS = 0  # NVML_SUCCESS


class GPU(NamedTuple):
    index: int  # type: ignore[assignment]  # NVML's index, in PCI bus order: shadows tuple.index, never called
    name: str  # "NVIDIA H100 80GB HBM3"; "" where NVML did not say
    uuid: str  # "GPU-5a1b..."; "" where NVML did not say
    capability: tuple[int, int] | None  # CUDA compute capability, (9, 0); None where NVML did not say


def gpus() -> list[GPU] | None:
    """Every GPU the driver knows (whatever ``CUDA_VISIBLE_DEVICES`` says), in NVML's order, or ``None`` where NVML
    cannot answer: the library is absent (no driver, or a container started without the driver's utility
    libraries), does not initialise, or lacks a function."""
    import ctypes

    try:
        lib = ctypes.CDLL(LIBRARY)
        init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
    except (OSError, AttributeError):
        return None
    if init() != SUCCESS:
        return None
    try:
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != SUCCESS:
            return None
        found = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != SUCCESS:
                return None
            name, uuid = ctypes.create_string_buffer(BUFFER), ctypes.create_string_buffer(BUFFER)
            major, minor = ctypes.c_int(-1), ctypes.c_int(-1)
            named = lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(BUFFER)) == SUCCESS
            has_uuid = lib.nvmlDeviceGetUUID(handle, uuid, ctypes.c_uint(BUFFER)) == SUCCESS
            capable = lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major),
                                                             ctypes.byref(minor)) == SUCCESS
            found.append(GPU(index, name.value.decode(errors="replace") if named else "",
                             uuid.value.decode(errors="replace") if has_uuid else "",
                             (major.value, minor.value) if capable and major.value >= 0 else None))
        return found
    except AttributeError:  # a driver too old for one of these functions
        return None
    finally:
        shutdown = getattr(lib, "nvmlShutdown", None)
        if shutdown is not None:
            shutdown()
