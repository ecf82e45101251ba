"""Profile training steps N..M on chosen ranks with ``torch.profiler``, on the selected plugin's device.

The equivalent of MindSpeed's ``--profile --profile-step-start N --profile-step-end M --profile-ranks R
--profile-with-memory`` for any plugin: the activities are the host and, when the device has a profiler
activity of its own (CUDA, or a PrivateUse1 vendor device that registered one), the device. Call
:meth:`StepProfiler.step` once at the end of every training step::

    profiler = StepProfiler(start=3, end=5, ranks=(0,), with_memory=True, output_dir="profile")
    for step in range(steps):
        train_step()
        profiler.step()

Steps ``start`` to ``end - 1`` (counted from 0) are recorded; ``output_dir/rank<R>.json`` is a Chrome trace.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch.profiler import ProfilerActivity


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def activities(device_type: str) -> list[ProfilerActivity]:
    """The host, plus the device's own activity where torch has one for it."""
    chosen = [ProfilerActivity.CPU]
    if device_type == "cuda":
        chosen.append(ProfilerActivity.CUDA)
    elif (device_type not in ("cpu", "meta") and hasattr(ProfilerActivity, "PrivateUse1")
          and torch._C._get_privateuse1_backend_name() == device_type):
        chosen.append(ProfilerActivity.PrivateUse1)
    return chosen


class StepProfiler:
    """Records steps ``start .. end - 1`` on ``ranks``; elsewhere every call is a counter increment."""

    def __init__(self, start: int, end: int, ranks: Iterable[int] = (0,), with_memory: bool = False,
                 output_dir: str = "profile", device_type: str | None = None, record_shapes: bool = False) -> None:
        if not 0 <= start < end:
            raise ValueError(f"profile steps {start}..{end}: need 0 <= start < end (end is exclusive)")
        self.start, self.end, self.output_dir = start, end, output_dir
        self.rank = _rank()
        self.enabled = self.rank in set(ranks)
        self._step = 0
        self._profiler: Any = None
        if self.enabled:
            if device_type is None:
                from devshim_core.session import current

                session = current()
                device_type = session.device.type if session is not None else "cpu"
            self._profiler = torch.profiler.profile(
                activities=activities(device_type), record_shapes=record_shapes, profile_memory=with_memory,
                with_stack=False,
                schedule=torch.profiler.schedule(wait=start, warmup=0, active=end - start, repeat=1),
                on_trace_ready=self._write)
            self._profiler.start()

    @property
    def trace_path(self) -> str:
        return os.path.join(self.output_dir, f"rank{self.rank}.json")

    def _write(self, profiler: Any) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        profiler.export_chrome_trace(self.trace_path)

    def step(self) -> None:
        self._step += 1
        if self._profiler is None:
            return
        self._profiler.step()
        if self._step >= self.end:
            self._profiler.stop()
            self._profiler = None
