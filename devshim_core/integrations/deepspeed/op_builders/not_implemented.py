"""The answer for every DeepSpeed op devshim does not serve: a clear error instead of a compiler run."""

from __future__ import annotations

from devshim_core.device import Device
from devshim_core.integrations.deepspeed.op_builders.base import DevshimOpBuilder


class NotImplementedBuilder(DevshimOpBuilder):
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"
    NAME = "deepspeed_not_implemented"

    def kernel_problem(self, device: Device) -> str | None:
        return "devshim has no implementation of this op"
