"""A plugin that misspells a hook name: devshim would otherwise silently never call it."""

from devshim_core import AllocatorSpec, DeviceReport, hookimpl


@hookimpl
def devshim_detect() -> DeviceReport:
    return DeviceReport(available=True, reason="typo device present", device_type="cpu", device_count=1,
                        priority=500)


@hookimpl
def devshim_allocater(report: DeviceReport) -> AllocatorSpec:  # sic: devshim_allocator
    raise AssertionError("never called")
