"""A plugin whose detection answers something that is not a DeviceReport."""

from devshim_core import hookimpl


@hookimpl
def devshim_detect() -> dict:
    return {"available": True, "device_type": "npu"}
