"""Sophgo as devshim emulates it: the ``tpu`` device of a simulated Sophgo ``torch_tpu`` (no int64 on the device,
the chip named by ``CHIP_ARCH``), and SCCL's rules as Sophgo's adaptor presents them (TPU tensors only; reductions
of bool/int8/uint8/int64 in int32 and of float64 in float32, cast back)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

NAME = "sophgo"
DEVICE_TYPE = "tpu"
BACKEND = "sccl"
SDK_PACKAGE = "torch_tpu"
SDK_METADATA = "torch_tpu-2.13.0.dist-info"
VISIBLE_DEVICES = "TPU_VISIBLE_DEVICES"
CHIP_ARCH_ENV = "CHIP_ARCH"
DEFAULT_CHIP = "sg2260"


def chip_arch() -> str:
    """The chip the SDK was built for (``CHIP_ARCH``: sg2260, bm1684x, ...; default sg2260)."""
    return os.environ.get(CHIP_ARCH_ENV, DEFAULT_CHIP).strip().lower() or DEFAULT_CHIP


def device_name() -> str:
    return f"Sophgo {chip_arch().upper()} (devshim emulation)"


def unsupported_dtypes() -> tuple[Any, ...]:
    import torch

    return (torch.int64,)  # Sophgo's LongTensor is int32; Tensor.tpu() refuses int64


def prepare_environment(sdk_path: Path) -> None:
    """Nothing: torch_tpu reads no install-location variable."""


def refuses(tensor: Any, what: str) -> str | None:
    """SCCL takes TPU tensors only (a host tensor goes through gloo only under the vendor's DS_USE_HOST_GLOO)."""
    if tensor.device.type == DEVICE_TYPE:
        return None
    return (f"SCCL {what}: tensors must be on the {DEVICE_TYPE} device, got a tensor on {tensor.device} (move it "
            f"with .to('{DEVICE_TYPE}') first; emulated {BACKEND} refuses what the real library refuses)")


def reduce_casts() -> dict[Any, Any]:
    """SCCL reduces 32-bit and narrower floats only; Sophgo's adaptor narrows the rest and casts back."""
    import torch

    return {torch.bool: torch.int32, torch.int8: torch.int32, torch.uint8: torch.int32, torch.int64: torch.int32,
            torch.float64: torch.float32}


def collective_rules() -> Any:
    from devshim_emulation.collectives import VendorRules

    return VendorRules(backend=BACKEND, device_type=DEVICE_TYPE, reduce_casts=reduce_casts(), refuses=refuses)
