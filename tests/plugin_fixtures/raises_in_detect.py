"""A plugin whose detection raises instead of answering "not available"."""

from devshim_core import DeviceReport, hookimpl


@hookimpl
def devshim_detect() -> DeviceReport:
    raise OSError("driver /dev/vendor0 is not loaded")
