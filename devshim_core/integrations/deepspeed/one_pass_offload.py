"""ZeRO-1/2 offload with bf16/fp16 weights in one pass over the fp32 master partition.

DeepSpeed 0.17-0.19's offload step runs the host Adam over each fp32 partition, then reads the partition again to
convert it into a host bf16/fp16 buffer (``bit16_partition_buffer.data.copy_(fp32_partition.data)``), which it
copies to the device. devshim's host Adam can write that buffer itself while it updates the partition. For the
length of a step, the ``cpu_adam`` op is given each partition's buffer, and the conversion copy that would
repeat the write is skipped. Any other copy into a buffer, and every buffer the kernel did not write, goes
through unchanged, so a step the kernel does not run (another optimizer, a gradient scaler) is DeepSpeed's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from devshim_core.integrations.deepspeed.ops import HostAdamOp

STAGE_1_AND_2_MODULE = "deepspeed.runtime.zero.stage_1_and_2"


@dataclass
class OnePassCounts:
    """Per optimizer: partitions whose device copy the host Adam wrote, and conversion copies skipped for them."""

    written: int = 0
    skipped: int = 0


class _StepState:
    """What one step's skipped copies are checked against (the op's ``copies_written``)."""

    op: HostAdamOp | None = None
    counts: OnePassCounts | None = None


class _BufferWrittenByAdam(torch.Tensor):
    """A view of a bf16/fp16 offload buffer for one step: ``copy_`` from the fp32 partition the host Adam has
    just written it from does nothing (the op's ``copies_written`` says which); every other operation is
    torch's. ``.data`` keeps the class, which is how DeepSpeed's ``buffer.data.copy_(...)`` reaches this."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        op, counts = _StepState.op, _StepState.counts
        if func is torch.Tensor.copy_ and op is not None and counts is not None and len(args) >= 2:
            destination, source = args[0], args[1]
            key = (destination.data_ptr(), source.data_ptr())
            if isinstance(destination, cls) and key in op.copies_written:
                op.copies_written.discard(key)
                counts.skipped += 1
                return destination
        return super().__torch_function__(func, types, args, kwargs or {})


def _host_adam_op(optimizer: Any) -> HostAdamOp | None:
    """devshim's ``cpu_adam`` op, when this ZeRO optimizer offloads and steps through it."""
    if not getattr(optimizer, "cpu_offload", False):
        return None
    op = getattr(getattr(optimizer, "optimizer", None), "ds_opt_adam", None)
    return op if isinstance(op, HostAdamOp) else None


def one_pass_step(original: Callable[..., Any], _device: Any) -> Callable[..., Any]:
    """``DeepSpeedZeroOptimizer.step`` that hands each fp32 partition's bf16/fp16 buffer to the host Adam."""

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        op = _host_adam_op(self)
        buffers = getattr(self, "param_buffer_of_bit16_for_cpu_offload_groups", None)
        if op is None or not buffers or _StepState.op is not None:
            return original(self, *args, **kwargs)
        counts = self.__dict__.setdefault("devshim_one_pass", OnePassCounts())
        op.param_copies = {fp32.data_ptr(): buffer
                           for fp32, buffer in zip(self.single_partition_of_fp32_groups, buffers, strict=True)}
        op.copies_written.clear()
        self.param_buffer_of_bit16_for_cpu_offload_groups = [b.as_subclass(_BufferWrittenByAdam) for b in buffers]
        _StepState.op, _StepState.counts = op, counts
        made = op.copies_made
        try:
            return original(self, *args, **kwargs)
        finally:
            counts.written += op.copies_made - made
            _StepState.op = _StepState.counts = None
            self.param_buffer_of_bit16_for_cpu_offload_groups = buffers
            op.param_copies = {}
            op.copies_written.clear()

    step.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return step
