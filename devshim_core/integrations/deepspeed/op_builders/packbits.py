"""``pack_bits``: the sign packing of 1-bit Adam/0/1 Adam/1-bit LAMB's ``compressed`` backend (DeepSpeed 0.14.3 to
0.19.6; DeepSpeed itself has it only for XPU)."""

from __future__ import annotations

from devshim_core.device import Device
from devshim_core.integrations.deepspeed.op_builders.base import DevshimOpBuilder
from devshim_core.integrations.deepspeed.ops import PackbitsOp


class PackbitsBuilder(DevshimOpBuilder):
    BUILD_VAR = "DS_BUILD_PACK_BITS"
    NAME = "pack_bits"

    def make_op(self, device: Device) -> PackbitsOp:
        return PackbitsOp()
