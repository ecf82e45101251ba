"""The shared base of devshim's op builders: nothing to compile, ``load()`` returns a Python object."""

from __future__ import annotations

from typing import Any

from deepspeed.ops.op_builder.builder import OpBuilder

from devshim_core.device import Device


def active_device() -> Device:
    from deepspeed.accelerator import get_accelerator

    device = getattr(get_accelerator(), "_devshim_device", None)
    if device is None:
        raise RuntimeError("devshim's op builders are used, but DeepSpeed's accelerator is not devshim's; "
                           "import devshim_core.auto before using DeepSpeed ops.")
    return device


class DevshimOpBuilder(OpBuilder):
    NAME = "devshim_op"
    # Like OpBuilder._loaded_ops: one op object per op and device, so that every load() shares its state
    # (cpu_adam's optimizer ids), as every load of the one compiled module does.
    _devshim_ops: dict[str, tuple[Device, Any]] = {}

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name=name or self.NAME)

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def sources(self) -> list[str]:
        return []

    def include_paths(self) -> list[str]:
        return []

    def kernel_problem(self, device: Device) -> str | None:
        """Why this op cannot be served on ``device``, or ``None``."""
        return None

    def op_description(self) -> str:
        """How the errors name this op."""
        return repr(self.name)

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.kernel_problem(active_device()) is None

    def make_op(self, device: Device) -> Any:
        raise NotImplementedError

    def load(self, verbose: bool = True) -> Any:
        device = active_device()
        loaded = self._devshim_ops.get(self.name)
        if loaded is not None and loaded[0] is device:
            return loaded[1]
        problem = self.kernel_problem(device)
        if problem is not None:
            raise RuntimeError(f"DeepSpeed op {self.op_description()} is not available through devshim plugin "
                               f"{device.plugin!r}: {problem}. devshim never JIT-compiles DeepSpeed ops.")
        op = self.make_op(device)
        self._devshim_ops[self.name] = (device, op)
        return op

    def jit_load(self, verbose: bool = True) -> Any:
        return self.load(verbose)

    def builder(self) -> Any:
        raise RuntimeError(f"devshim's {self.name} op is not built ahead of time; it has nothing to compile.")
