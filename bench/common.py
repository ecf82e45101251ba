"""What every benchmark shares: min-of-repeats timing and the comparison record the runner prints.

A benchmark never asserts a speed. It measures devshim and its peer in the same process (or the same run),
interleaved, and reports the ratio ``devshim_seconds / peer_seconds`` against the issue's target.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


def environment_without_devshim() -> dict[str, str]:
    """This process's environment minus devshim's switches and ``DS_ACCELERATOR``: what a contender
    process starts from, so neither side inherits the other's configuration."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_") and k != "DS_ACCELERATOR"}


def free_port() -> int:
    """A TCP port free on the loopback interface now, for a contender's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_min(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 2,
             sync: Callable[[], object] | None = None) -> float:
    """The minimum wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        best = min(best, time.perf_counter() - start)
    return best


def time_min_interleaved(fns: dict[str, Callable[[], object]], *, repeats: int = 7,
                         warmup: int = 2) -> dict[str, float]:
    """Like :func:`time_min` for several contenders, alternating them so machine noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@dataclass
class Comparison:
    """devshim against one peer in one configuration.

    ``ratio`` is devshim's time over the peer's (below 1 = devshim faster). ``max_ratio`` is the target
    written as the largest acceptable time ratio (a "≥ 2× faster" target is ``0.5``; "≥ 0.95× the peer's
    speed" is ``1 / 0.95``); ``target`` states it in the issue's words.
    """

    group: str  # e.g. "host_adam", "attention", "fused_ops", "end_to_end", "import"
    case: str  # the configuration, e.g. "100M fp32 + bf16 copy"
    subject: str  # e.g. "devshim (native)"
    subject_seconds: float
    peer: str  # e.g. "torch.optim.AdamW(fused=True)"
    peer_seconds: float
    max_ratio: float
    target: str
    details: dict[str, Any] = field(default_factory=dict)  # bytes moved, GB/s, build time, ...

    @property
    def ratio(self) -> float:
        return self.subject_seconds / self.peer_seconds

    @property
    def met(self) -> bool:
        return self.ratio <= self.max_ratio

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


@dataclass
class Note:
    """A measurement that is not a ratio against a peer (a build time, a bandwidth, an absolute cost)."""

    group: str
    name: str
    value: float
    unit: str
    target: str = ""
    met: bool | None = None  # None: informational only

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


Result = Comparison | Note
