"""The answer for every DeepSpeed op devshim does not serve: a clear error instead of a compiler run."""

from __future__ import annotations

import functools

from devshim_core.device import Device
from devshim_core.integrations.deepspeed.op_builders.base import DevshimOpBuilder

# what a user was doing when DeepSpeed asked for the op, and what to do instead
_WHAT_NEEDS_IT = {
    "InferenceBuilder": "kernel injection (init_inference(replace_with_kernel_inject=True)) needs it; "
                        "replace_with_kernel_inject=False shards the model with AutoTP instead",
    "InferenceCoreBuilder": "kernel injection needs it; replace_with_kernel_inject=False shards with AutoTP instead",
    "AsyncIOBuilder": "ZeRO-Infinity's NVMe offload needs it; offload to 'cpu' instead",
    "GDSBuilder": "ZeRO-Infinity's NVMe offload needs it; offload to 'cpu' instead",
}


class NotImplementedBuilder(DevshimOpBuilder):
    """Every op builder devshim has no implementation for; :func:`not_implemented` names the one asked for."""

    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"
    NAME = "deepspeed_not_implemented"
    REQUESTED = "an op builder"

    def kernel_problem(self, device: Device) -> str | None:
        hint = _WHAT_NEEDS_IT.get(self.REQUESTED)
        return f"devshim has no implementation of {self.REQUESTED}" + (f" ({hint})" if hint else "")


@functools.cache
def not_implemented(class_name: str) -> type[NotImplementedBuilder]:
    """The builder class DeepSpeed gets for ``class_name`` (one per name, so its error can name it)."""
    return type(class_name, (NotImplementedBuilder,), {"NAME": class_name, "REQUESTED": class_name,
                                                       "__module__": __name__})
