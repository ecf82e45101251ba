"""``fused_adam`` and ``cpu_adam`` served by the selected plugin's optimizer kernels."""

from __future__ import annotations

from devshim_core.device import Device
from devshim_core.integrations.deepspeed.op_builders.base import DevshimOpBuilder
from devshim_core.integrations.deepspeed.ops import FusedAdamOp, HostAdamOp


class FusedAdamBuilder(DevshimOpBuilder):
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    NAME = "fused_adam"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def kernel_problem(self, device: Device) -> str | None:
        if device.optimizer.fused_adamw is None:
            return "the plugin provides no fused AdamW kernel"
        return None

    def make_op(self, device: Device) -> FusedAdamOp:
        assert device.optimizer.fused_adamw is not None
        return FusedAdamOp(device.optimizer.fused_adamw)


class CPUAdamBuilder(DevshimOpBuilder):
    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    NAME = "cpu_adam"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def kernel_problem(self, device: Device) -> str | None:
        if device.optimizer.host_adam_step is None:
            return "the plugin provides no host Adam kernel"
        return None

    def make_op(self, device: Device) -> HostAdamOp:
        assert device.optimizer.host_adam_step is not None
        return HostAdamOp(device.optimizer.host_adam_step, device.optimizer.host_adam_rollback)
