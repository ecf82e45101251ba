"""A plugin whose detection never returns (a vendor runtime waiting on a device that does not answer)."""

import time

from devshim_core import DeviceReport, hookimpl


@hookimpl
def devshim_detect() -> DeviceReport:
    time.sleep(3600)
    raise AssertionError("never reached")
