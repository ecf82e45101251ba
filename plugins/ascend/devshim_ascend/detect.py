"""Safe detection of an Ascend NPU: package present, CANN runtime present, then import, then devices.

torch_npu is imported only once the CANN toolkit has been seen (or when something already imported it):
without CANN the import fails, and every way it can fail gets a reason that says what to do.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import sys
from typing import NamedTuple

CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
SET_ENV = "source CANN's set_env.sh (by default /usr/local/Ascend/ascend-toolkit/set_env.sh)"
NOT_INSTALLED = ("torch_npu is not installed (install Huawei's torch-npu matching your torch, with the CANN "
                 "toolkit)")
IMPORTED_EARLIER = "an unknown place (torch_npu was imported before devshim looked)"
DEEPSPEED_TRAP = ("without it DeepSpeed's own NPU accelerator (DS_ACCELERATOR=npu) also fails, with "
                  "KeyError: 'ASCEND_HOME_PATH'")


class Found(NamedTuple):  # not a dataclass: this module loads on every start, and those cost ~1 ms
    ok: bool
    reason: str
    device_count: int = 0


def cann_location() -> str | None:
    """Where the CANN toolkit is (``NAME=path`` or the ascendcl library), or ``None``."""
    for name in CANN_ENV:
        path = os.environ.get(name)
        if path and os.path.isdir(path):
            return f"{name}={path}"
    library = ctypes.util.find_library("ascendcl")
    return f"lib{library}" if library else None


def stale_cann_variables() -> list[str]:
    """The CANN variables that are set but name no directory (a moved or removed toolkit)."""
    return [name for name in CANN_ENV if os.environ.get(name) and not os.path.isdir(os.environ[name])]


def _autoload_note() -> str:
    """When torch_npu is broken but torch would load it on ``import torch``: say how to keep torch usable."""
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
        return ""
    from importlib import metadata

    try:
        entry_points = metadata.entry_points(group="torch.backends")
    except Exception:  # a broken distribution elsewhere must not break detection
        return ""
    if not any(ep.value.split(":")[0].split(".")[0] == "torch_npu" for ep in entry_points):
        return ""
    return ("; until then `import torch` itself fails in new processes ('Failed to load the backend extension: "
            "torch_npu', torch_npu's torch.backends entry point): set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use torch "
            "without the NPU meanwhile")


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _version_mismatch() -> str | None:
    """torch-npu is built for one torch minor: say so when the installed torch is another."""
    from importlib import metadata

    try:
        npu_version, torch_version = metadata.version("torch-npu"), metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    if _minor(npu_version) == _minor(torch_version):
        return None
    return (f"torch-npu {npu_version} is built for torch {_minor(npu_version)} but torch {torch_version} is "
            f"installed: install the torch-npu release for torch {_minor(torch_version)} (or the torch its release "
            "requires)")


def _load_failure(exc: BaseException, cann: str) -> str:
    error = f"{type(exc).__name__}: {exc}"
    advice = _version_mismatch() or ("this usually means the CANN version does not match this torch-npu release "
                                     "(each torch-npu release supports specific CANN versions): install the CANN "
                                     "version your torch-npu requires and " + SET_ENV)
    return f"torch_npu failed to load with CANN at {cann}: {error}; {advice}{_autoload_note()}"


def detect() -> Found:
    imported = "torch_npu" in sys.modules  # e.g. by torch's backend autoload: nothing speculative left to avoid
    if not imported and importlib.util.find_spec("torch_npu") is None:
        return Found(False, NOT_INSTALLED)
    stale = [] if imported else stale_cann_variables()
    if stale:
        named = " and ".join(f"{name}={os.environ[name]}" for name in stale)
        return Found(False, f"torch_npu is installed but {named} names no directory (no such CANN toolkit "
                            f"there): point {stale[0]} at the installed toolkit (e.g. "
                            f"/usr/local/Ascend/ascend-toolkit/latest) or {SET_ENV}, which sets it{_autoload_note()}")
    cann = cann_location() or (IMPORTED_EARLIER if imported else None)
    if cann is None:
        return Found(False, "torch_npu is installed but the CANN toolkit was not found (ASCEND_HOME_PATH and "
                            "ASCEND_TOOLKIT_HOME are unset, no libascendcl on the library path): "
                            f"{SET_ENV} or set ASCEND_HOME_PATH; {DEEPSPEED_TRAP}{_autoload_note()}")
    try:
        import torch
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:
        return Found(False, _load_failure(exc, cann))
    try:
        available = torch.npu.is_available()  # type: ignore[attr-defined]  # registered by torch_npu
        count = torch.npu.device_count() if available else 0  # type: ignore[attr-defined]  # registered by torch_npu
    except (RuntimeError, AttributeError) as exc:
        return Found(False, f"torch_npu loaded (CANN at {cann}) but asking it for NPUs failed: "
                            f"{type(exc).__name__}: {exc}; check the Ascend driver and firmware (npu-smi info)")
    if not count:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        where = (f"ASCEND_RT_VISIBLE_DEVICES={visible!r} may hide them" if visible is not None
                 else "check ASCEND_RT_VISIBLE_DEVICES")
        return Found(False, f"torch_npu and CANN ({cann}) are installed but no NPU is visible ({where}; check the "
                            "driver with npu-smi info)")
    return Found(True, f"{count} Ascend NPUs (torch_npu, CANN at {cann})", count)
