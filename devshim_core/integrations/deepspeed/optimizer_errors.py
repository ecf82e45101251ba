"""Name the parameter group of a failed Adam kernel call.

DeepSpeed's optimizers call the ``cpu_adam`` / ``fused_adam`` ops per parameter or per group, and
``DeepSpeedCPUAdam`` discards the op's return code: an error reported as -1 froze a parameter group in silence.
devshim's ops raise :class:`~devshim_core.errors.KernelCallError` instead, holding a tensor of the call; the
optimizer's methods, wrapped here, add which group and parameter that tensor is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from devshim_core.errors import KernelCallError


def locate(optimizer: Any, tensor: Any) -> str:
    """'param group G, parameter I (shape, dtype)' for the parameter whose data ``tensor`` is."""
    if tensor is not None:
        pointer = tensor.data_ptr()
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.data_ptr() == pointer:
                    return f"param group {g}, parameter {i} (shape {tuple(p.shape)}, {p.dtype})"
    return "a parameter not found in its param_groups"


def naming_the_group(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of an optimizer, re-raising a kernel's error with the parameter group named."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except KernelCallError as error:
            if error.located:  # a wrapped method called another: named once
                raise
            raise KernelCallError(f"{type(self).__name__}.{method.__name__}: {locate(self, error.tensor)}: {error}",
                                  error.tensor, located=True) from error

    call.__devshim_original__ = method  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return call
