"""A plugin whose detection calls sys.exit(), as some vendor SDKs do when their runtime is missing."""

import sys

from devshim_core import DeviceReport, hookimpl


@hookimpl
def devshim_detect() -> DeviceReport:
    sys.exit("vendor runtime not found, exiting")
