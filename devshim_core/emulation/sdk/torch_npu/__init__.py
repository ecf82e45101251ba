"""Simulated ``torch_npu`` (devshim emulation): importing it brings up the emulated ``npu`` device.

Like Huawei's package, the import registers the ``npu`` device (``torch.npu``), the ``hccl`` backend and the
``torch.ops.npu`` operators. The device is devshim's host-memory emulator and the operators compute with
``devshim_kernels``; see ``devshim_core.emulation``. Not Huawei's code.
"""

import torch

from devshim_core import emulation
from devshim_core.emulation.collectives import VendorRules, register_backend

__version__ = "2.13.0+devshim.emulated"
EMULATED = True

npu = emulation.enable_device("npu", device_count=emulation.visible_device_count("ASCEND_RT_VISIBLE_DEVICES"),
                              device_name="Ascend910B2 (devshim emulation)")
register_backend(VendorRules(backend="hccl", device_type="npu"), emulation.host_alias)

from torch_npu import _ops, optim  # noqa: E402  (the device must exist before its ops register)
from torch_npu._ops import (  # noqa: E402
    npu_apply_adam_w,
    npu_fusion_attention,
    npu_rms_norm,
    npu_rotary_mul,
    npu_swiglu,
)

__all__ = ["EMULATED", "npu", "npu_apply_adam_w", "npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul",
           "npu_swiglu", "optim"]
assert torch.npu is npu and _ops is not None
