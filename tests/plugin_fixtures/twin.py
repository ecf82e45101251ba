"""Two distributions ship a plugin named ``twin``; these are their two modules."""

from devshim_core import DeviceReport, hookimpl


class _Twin:
    def __init__(self, origin: str) -> None:
        self.origin = origin

    @hookimpl
    def devshim_detect(self) -> DeviceReport:
        return DeviceReport(available=True, reason=f"twin from {self.origin}", device_type="cpu", device_count=1,
                            priority=1)


from_a = _Twin("devshim-twin-a")
from_b = _Twin("devshim-twin-b")
