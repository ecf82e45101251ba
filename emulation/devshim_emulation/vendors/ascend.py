"""Huawei Ascend as devshim emulates it: the ``npu`` device of a simulated ``torch_npu``, CANN's location, and
HCCL's rules (it takes NPU tensors only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

NAME = "ascend"
DEVICE_TYPE = "npu"
BACKEND = "hccl"
SDK_PACKAGE = "torch_npu"
SDK_METADATA = "torch_npu-2.13.0.dist-info"
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"


def device_name() -> str:
    return "Ascend910B2 (devshim emulation)"


def unsupported_dtypes() -> tuple[Any, ...]:
    return ()  # torch_npu moves every dtype to the device


def prepare_environment(sdk_path: Path) -> None:
    """CANN's install location, which torch_npu and DeepSpeed's NPU op builders read (DeepSpeed 0.19 indexes
    ``os.environ['ASCEND_HOME_PATH']`` and fails without it); the simulated SDK carries a stand-in."""
    os.environ.setdefault("ASCEND_HOME_PATH", str(sdk_path / "cann"))


def refuses(tensor: Any, what: str) -> str | None:
    """HCCL takes NPU tensors only: a CPU tensor (or another device's) is an error, never staged for the caller."""
    if tensor.device.type == DEVICE_TYPE:
        return None
    return (f"HCCL {what}: tensors must be on the {DEVICE_TYPE} device, got a tensor on {tensor.device} (move it "
            f"with .to('{DEVICE_TYPE}') first; emulated {BACKEND} refuses what the real library refuses)")


def collective_rules() -> Any:
    from devshim_emulation.collectives import VendorRules

    return VendorRules(backend=BACKEND, device_type=DEVICE_TYPE, refuses=refuses)
