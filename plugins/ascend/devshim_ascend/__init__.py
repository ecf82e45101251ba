"""devshim plugin for Huawei Ascend NPUs.

This release detects an Ascend installation and explains what it found; driving the NPU (device
module, hccl, fused kernels) comes with the Ascend issue. Detection never imports torch_npu before it
has seen the CANN runtime: without CANN, importing torch_npu fails (and, installed, it can break
``import torch`` through its ``torch.backends`` entry point).
"""

from __future__ import annotations

from devshim_ascend.detect import detect
from devshim_core import DeviceReport, hookimpl

PRIORITY = 100


@hookimpl
def devshim_detect() -> DeviceReport:
    found = detect()
    if not found.ok:
        return DeviceReport(available=False, reason=found.reason, device_type="npu", priority=PRIORITY)
    return DeviceReport(available=False, device_type="npu", priority=PRIORITY,
                        reason=f"{found.reason}, but devshim-ascend 0.1 only detects NPUs; it does not drive them "
                               "yet")
