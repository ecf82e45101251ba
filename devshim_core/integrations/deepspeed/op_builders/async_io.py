"""``async_io`` (ZeRO-Infinity's NVMe offload) served by the plugin's offload file I/O."""

from __future__ import annotations

from devshim_core.device import Device
from devshim_core.integrations.deepspeed.aio import AsyncIOOp
from devshim_core.integrations.deepspeed.op_builders.base import DevshimOpBuilder


class AsyncIOBuilder(DevshimOpBuilder):
    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.aio.{self.NAME}_op"

    def kernel_problem(self, device: Device) -> str | None:
        if device.offload_io.file_io is None:
            return f"the plugin provides no asynchronous file I/O ({device.offload_io.source or 'no reason given'})"
        return None

    def make_op(self, device: Device) -> AsyncIOOp:
        assert device.offload_io.file_io is not None
        pin = None
        if device.traits.pin_memory:
            from deepspeed.accelerator import get_accelerator

            pin = get_accelerator().pin_memory
        return AsyncIOOp(device.offload_io.file_io, pin)
