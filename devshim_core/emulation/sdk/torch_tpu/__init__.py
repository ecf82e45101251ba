"""Simulated Sophgo ``torch_tpu`` (devshim emulation): importing it brings up the emulated ``tpu`` device.

Like Sophgo's package, the import registers the ``tpu`` device (``torch.tpu``), the ``sccl`` backend and the
``torch.ops.my_ops`` out-parameter kernels; int64 cannot be moved to the device with ``Tensor.tpu()``. The
device is devshim's host-memory emulator and the kernels compute with ``devshim_kernels``; see
``devshim_core.emulation``. Not Sophgo's code.
"""

import os

import torch

from devshim_core import emulation
from devshim_core.emulation.collectives import VendorRules, register_backend

__version__ = "2.13.0+devshim.emulated"
EMULATED = True
CHIP_ARCH = os.environ.get("CHIP_ARCH", "sg2260").strip().lower() or "sg2260"

_device = emulation.enable_device("tpu", device_count=lambda: emulation.visible_device_count("TPU_VISIBLE_DEVICES"),
                                  device_name=f"Sophgo {CHIP_ARCH.upper()} (devshim emulation)",
                                  unsupported_dtypes=(torch.int64,))
# SCCL reduces 32-bit and narrower floats only; Sophgo's adaptor narrows the rest and casts back
_NARROWED = {torch.bool: torch.int32, torch.int8: torch.int32, torch.uint8: torch.int32, torch.int64: torch.int32,
             torch.float64: torch.float32}
register_backend(VendorRules(backend="sccl", device_type="tpu", reduce_casts=_NARROWED), emulation.host_alias)

from torch_tpu import _ops, tpu  # noqa: E402  (the device must exist before its ops register)

__all__ = ["CHIP_ARCH", "EMULATED", "tpu"]
assert _ops is not None
