"""Simulated Sophgo ``torch_tpu`` (devshim emulation): importing it brings up the emulated ``tpu`` device.

Like Sophgo's package, the import registers the ``tpu`` device (``torch.tpu``), the ``sccl`` backend and the
``torch.ops.my_ops`` out-parameter kernels; int64 cannot be moved to the device with ``Tensor.tpu()``. The
device is devshim's host-memory emulator and the kernels compute with plain torch (never ``devshim_kernels``); see
``devshim_emulation`` and ``devshim_emulation.vendors.sophgo`` (SCCL's dtype narrowing). Not Sophgo's code.
"""

from devshim_emulation import vendors
from devshim_emulation.vendors import sophgo

__version__ = "2.13.0+devshim.emulated"
EMULATED = True
CHIP_ARCH = sophgo.chip_arch()

_device = vendors.enable("sophgo")  # the tpu device (no int64) and the sccl backend

from torch_tpu import _ops, tpu  # noqa: E402  (the device must exist before its ops register)

__all__ = ["CHIP_ARCH", "EMULATED", "tpu"]
assert _ops is not None
