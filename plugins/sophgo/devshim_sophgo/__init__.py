"""devshim plugin for Sophgo TPUs.

This release detects Sophgo's ``torch_tpu`` and explains what it found; driving the TPU comes with the
Sophgo issue. ``torch_tpu`` is also the import name of Google's TorchTPU, which aborts the interpreter
when imported without Google's runtime, so detection reads metadata and files and never imports it.
"""

from __future__ import annotations

from devshim_core import DeviceReport, hookimpl
from devshim_sophgo.detect import detect

PRIORITY = 100


@hookimpl
def devshim_detect() -> DeviceReport:
    found = detect()
    if not found.ok:
        return DeviceReport(available=False, reason=found.reason, device_type="tpu", priority=PRIORITY)
    return DeviceReport(available=False, device_type="tpu", priority=PRIORITY,
                        reason=f"{found.reason}, but devshim-sophgo 0.1 only detects TPUs; it does not drive them "
                               "yet")
