"""Safe detection of an Ascend NPU: package present, CANN runtime present, then import, then devices."""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
from typing import NamedTuple

CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")


class Found(NamedTuple):  # not a dataclass: this module loads on every start, and those cost ~1 ms
    ok: bool
    reason: str
    device_count: int = 0


def cann_location() -> str | None:
    for name in CANN_ENV:
        path = os.environ.get(name)
        if path and os.path.isdir(path):
            return f"{name}={path}"
    library = ctypes.util.find_library("ascendcl")
    return f"lib{library}" if library else None


def detect() -> Found:
    if importlib.util.find_spec("torch_npu") is None:
        return Found(False, "torch_npu is not installed (install Huawei's torch-npu matching your torch, "
                            "with the CANN toolkit)")
    cann = cann_location()
    if cann is None:
        return Found(False, "torch_npu is installed but the CANN toolkit was not found: source CANN's set_env.sh "
                            "or set ASCEND_HOME_PATH")
    try:
        import torch
        import torch_npu  # noqa: F401

        available = torch.npu.is_available()
        count = torch.npu.device_count() if available else 0
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        return Found(False, f"torch_npu failed to load with CANN at {cann}: {type(exc).__name__}: {exc}")
    if not count:
        return Found(False, f"torch_npu and CANN ({cann}) are installed but no NPU is visible "
                            "(check ASCEND_RT_VISIBLE_DEVICES and the driver)")
    return Found(True, f"{count} Ascend NPUs (torch_npu, CANN at {cann})", count)
