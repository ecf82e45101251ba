"""The versions of the software under the device, for ``devshim info``: read from torch's build, the libraries torch
loaded and ``/proc`` or ``/sys``, never by initialising a device."""

from __future__ import annotations

import torch

from devshim_cuda import detect


def _dotted(code: int, *, new_scheme_from: int) -> str:
    """A packed version number as ``major.minor.patch``: ``major*10000 + minor*100 + patch`` from
    ``new_scheme_from`` on, ``major*1000 + minor*100 + patch`` below (cuDNN 8 and NCCL before 2.9)."""
    if code >= new_scheme_from:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def cudnn_version() -> str | None:
    try:
        code = torch.backends.cudnn.version()
    except Exception:  # a cuDNN that does not load, or differs from the one torch was built with
        return None
    return _dotted(int(code), new_scheme_from=10000) if code else None


def nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL: torch._C has no _nccl_version
        return None
    if isinstance(version, int):  # torch before 1.13 packed it into one number
        return _dotted(version, new_scheme_from=20900)
    if isinstance(version, tuple) and version:
        numbers = ".".join(str(part) for part in version[:3])
        suffix = "".join(str(part) for part in version[3:])
        return numbers + (f"-{suffix}" if suffix else "")
    return None


def runtime_versions() -> dict[str, str]:
    """``{"CUDA runtime": "12.4", "cuDNN": "9.1.0", "NCCL": "2.21.5", "driver": "550.54.14"}``, or on ROCm
    ``{"HIP": ..., "RCCL": ..., "driver": ...}``; what cannot be read is left out."""
    hip = detect.hip_version()
    found: dict[str, str | None] = {}
    if hip:
        found["HIP"] = hip
        found["RCCL"] = nccl_version()
        found["driver"] = detect.amdgpu_driver_version()
    else:
        found["CUDA runtime"] = detect.cuda_version()
        found["cuDNN"] = cudnn_version()
        found["NCCL"] = nccl_version()
        found["driver"] = detect.nvidia_driver_version()
    return {name: str(value) for name, value in found.items() if value}
