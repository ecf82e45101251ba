"""Simulated ``torch_npu`` (devshim emulation): importing it brings up the emulated ``npu`` device.

Like Huawei's package, the import registers the ``npu`` device (``torch.npu``), the ``hccl`` backend and the
``torch.ops.npu`` operators. The device is devshim's host-memory emulator and the operators compute with plain
torch (never ``devshim_kernels``: they are the independent side of the conformance kit's comparison); see
``devshim_emulation`` and ``devshim_emulation.vendors.ascend``. Not Huawei's code.
"""

import torch
from devshim_emulation import vendors

__version__ = "2.13.0+devshim.emulated"
EMULATED = True

npu = vendors.enable("ascend")  # the npu device and the hccl backend


class _LegacyTensorType(type):
    """Huawei's ``torch.npu.FloatTensor`` & co. (legacy tensor types, bound by torch_npu's C++ like
    ``torch.cuda.FloatTensor``): calling one makes a tensor of its dtype on the current npu device, from data
    (``IntTensor([0])``) or sizes (``FloatTensor(2, 3)``); ``isinstance`` matches npu tensors of its dtype."""

    dtype: torch.dtype

    def __call__(cls, *args):
        device = torch.device("npu", npu.current_device())
        if len(args) == 1 and isinstance(args[0], torch.Size):
            args = tuple(args[0])
        elif len(args) == 1 and not isinstance(args[0], int):
            return torch.tensor(args[0], dtype=cls.dtype, device=device)
        return torch.empty(args or (0,), dtype=cls.dtype, device=device)

    def __instancecheck__(cls, instance):
        return isinstance(instance, torch.Tensor) and instance.device.type == "npu" and instance.dtype == cls.dtype


for _name, _dtype in (("BoolTensor", torch.bool), ("ByteTensor", torch.uint8), ("CharTensor", torch.int8),
                      ("DoubleTensor", torch.float64), ("FloatTensor", torch.float32), ("HalfTensor", torch.float16),
                      ("IntTensor", torch.int32), ("LongTensor", torch.int64), ("ShortTensor", torch.int16),
                      ("BFloat16Tensor", torch.bfloat16)):
    setattr(npu, _name, _LegacyTensorType(_name, (), {"dtype": _dtype, "__module__": "torch.npu"}))
del _name, _dtype

from torch_npu import _ops, amp, optim  # noqa: E402  (the device must exist before its ops register)

npu.amp = amp  # torch.npu.amp, as torch_npu's torch.npu module has it
from torch_npu._ops import (  # noqa: E402
    npu_apply_adam_w,
    npu_fusion_attention,
    npu_grouped_matmul,
    npu_rms_norm,
    npu_rotary_mul,
    npu_swiglu,
)

__all__ = ["EMULATED", "amp", "npu", "npu_apply_adam_w", "npu_fusion_attention", "npu_grouped_matmul", "npu_rms_norm",
           "npu_rotary_mul", "npu_swiglu", "optim"]
assert torch.npu is npu and _ops is not None
