"""A plugin whose detection returns a DeviceReport that breaks its own rules (available with no devices)."""

from devshim_core import DeviceReport, hookimpl


@hookimpl
def devshim_detect() -> DeviceReport:
    return DeviceReport(available=True, reason="ready", device_type="npu", device_count=0, priority=500)
