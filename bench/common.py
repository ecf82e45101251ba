"""What every benchmark shares: the records the runner prints and writes, and a contender's clean environment.

A benchmark never asserts a speed. It measures devshim and its peer in the same run, in paired, interleaved
rounds, and reports the geometric mean of the per-round ratios devshim / peer with its interval
(:mod:`bench.stats`) against the issue's target.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.stats import Estimate, paired_ratio, verdict
from devshim_core.testing.launch import free_port  # noqa: F401  (re-exported: one rendezvous-port rule for tests, kit, benches)


def environment_without_devshim() -> dict[str, str]:
    """This process's environment minus devshim's switches and ``DS_ACCELERATOR``: what a contender
    process starts from, so neither side inherits the other's configuration."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_") and k != "DS_ACCELERATOR"}


_EXIT_ABORT_MARKER = "terminate called without an active exception"
_RANK_EXIT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def only_the_upstream_exit_abort(returncode: int | None, stderr: str) -> bool:
    """Whether a ``torchrun`` job failed only by PyTorch's exit abort (pytorch/pytorch#117762).

    That abort hits a rank *after* its script returned, while the interpreter finalizes: a gloo worker thread
    calls ``std::terminate``. devshim's set ``torch.distributed-exit`` prevents it, so a run without devshim (a
    peer) is exposed to it, in about 2% of short 2-rank jobs (``stress/``). True only if the abort message was
    printed and every rank torchrun lists as failed died of SIGABRT (-6) or of the SIGTERM (-15) the agent then
    sends the others; a rank that raised, or any other exit code, is a real failure.
    """
    if returncode in (0, None) or _EXIT_ABORT_MARKER not in stderr:
        return False
    codes = {int(code) for code in _RANK_EXIT_CODE.findall(stderr)}
    return -6 in codes and codes <= {-6, -15}




def largest_relative_difference(values: list[float], reference: list[float]) -> float:
    """max |a - b| / |b| over the pairs: how far two contenders' losses drifted apart at one step."""
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


def seconds_text(value: float) -> str:
    """A time in the unit that shows it best: µs, ms or s."""
    if value < 1e-3:
        return f"{value * 1e6:.2f} µs"
    return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.2f} s"


@dataclass
class Comparison:
    """devshim against one peer in one configuration, measured in paired rounds (:mod:`bench.stats`).

    ``subject_rounds[i]`` and ``peer_rounds[i]`` are the two contenders' times in round ``i``. ``ratio`` is the
    geometric mean of the per-round ratios (below 1 = devshim faster), ``ci_low``/``ci_high`` its bootstrap 95%
    interval. ``max_ratio`` is the target written as the largest acceptable time ratio (a "≥ 2× faster" target
    is ``0.5``; "≥ 0.95× the peer's speed" is ``1 / 0.95``); ``target`` states it in the issue's words. A row
    with ``judged=False`` is informational: reported with its interval, never counted as a target.
    ``kernel_only`` marks a kernel timed in isolation, not a user's training step.
    """

    group: str  # e.g. "host_adam", "attention", "fused_ops", "end_to_end", "import"
    case: str  # the configuration, e.g. "100M fp32 + bf16 copy"
    subject: str  # e.g. "devshim (native)"
    subject_rounds: list[float]
    peer: str  # e.g. "torch.optim.AdamW(fused=True)"
    peer_rounds: list[float]
    max_ratio: float
    target: str
    details: dict[str, Any] = field(default_factory=dict)  # bytes moved, GB/s, memory, losses, ...
    judged: bool = True
    kernel_only: bool = False
    # the operators each contender's work is done by (bench.kernel_calls.kernels_run), where the bench knows them
    subject_kernels: tuple[str, ...] | None = None
    peer_kernels: tuple[str, ...] | None = None
    estimate: Estimate = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.estimate = paired_ratio(self.subject_rounds, self.peer_rounds)
        problem = self_comparison({"subject_kernels": self.subject_kernels, "peer_kernels": self.peer_kernels,
                                   "peer": self.peer})
        if self.judged and problem:
            raise ValueError(f"{self.group} {self.case}: {problem}; a row that times a kernel against itself is "
                             "informational (judged=False)")

    @property
    def subject_seconds(self) -> float:
        return statistics.geometric_mean(self.subject_rounds)

    @property
    def peer_seconds(self) -> float:
        return statistics.geometric_mean(self.peer_rounds)

    @property
    def ratio(self) -> float:
        return self.estimate.ratio

    @property
    def added_seconds(self) -> list[float]:
        """What devshim adds to the peer's time, at the estimate and at each end of its interval."""
        return [(r - 1) * self.peer_seconds for r in (self.ratio, self.estimate.low, self.estimate.high)]

    @property
    def verdict(self) -> str:
        return verdict(self.estimate, self.max_ratio) if self.judged else "informational"

    def as_json(self) -> dict[str, Any]:
        found = asdict(self)
        found.pop("estimate")
        return {**found, "subject_seconds": self.subject_seconds, "peer_seconds": self.peer_seconds,
                "rounds": len(self.subject_rounds), "ratio": self.ratio, "ci_low": self.estimate.low,
                "ci_high": self.estimate.high, "verdict": self.verdict}


def self_comparison(row: dict[str, Any]) -> str | None:
    """Why ``row`` (a comparison, or its JSON) times a kernel against itself, or ``None``."""
    ours, theirs = row.get("subject_kernels"), row.get("peer_kernels")
    if ours and theirs and tuple(ours) == tuple(theirs):
        return f"devshim and {row.get('peer')} both run {', '.join(ours)}"
    return None


@dataclass
class Note:
    """An informational measurement that is not a timed ratio (a build time, a memory figure, a count).

    Never a target: what is judged is judged as a :class:`Comparison`.
    """

    group: str
    name: str
    value: float
    unit: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


Result = Comparison | Note
