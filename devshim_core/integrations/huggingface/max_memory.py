"""Accelerate's memory budget for ``device_map='auto'`` on the host CPU: the host's RAM, once.

``get_max_memory`` lists ``torch.cuda``'s devices by index, then ``'cpu'``. On the host CPU the redirect's device 0
*is* the host, so the budget counted the same RAM twice and the map put modules on device ``0``, which transformers
then turns into ``torch.device(0)``: "Cannot access accelerator device when none is available" on a machine without
one. Without devshim the budget there is ``{'cpu': ...}`` alone, and so it is again. A budget the caller passed is
kept as given; on any other device the function is Accelerate's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devshim_core.device import Device


def host_budget(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def get_max_memory(max_memory: dict[int | str, int | str] | None = None) -> dict[int | str, int]:
        budget = original(max_memory)
        if max_memory is None and device.type == "cpu":
            return {key: value for key, value in budget.items() if not isinstance(key, int)}
        return budget

    get_max_memory.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    return get_max_memory
