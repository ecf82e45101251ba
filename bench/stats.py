"""The one statistic every timed comparison is judged by, fixed before any number is seen.

A comparison runs its contenders in paired rounds: in each round every contender is timed once, in an order
that alternates from round to round, so that a slow moment of the machine lands in one round and hits both
sides of it. Each round gives one ratio ``subject / peer``. The estimate is the geometric mean of those ratios;
its 95% confidence interval is the studentized (bootstrap-t) bootstrap of the mean of their logarithms
(``RESAMPLES`` resamples with a fixed seed, so the same figures always give the same interval). Studentized
rather than percentile because the bench has 6 to 15 rounds, where a percentile interval is too narrow:
:func:`coverage` measures both. Against a target written as a largest acceptable ratio, the verdict is:

- ``met`` when the whole interval is at or below the target;
- ``missed`` when the whole interval is above it;
- ``inconclusive`` otherwise: the run cannot tell.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RESAMPLES = 10_000
SEED = 0
CONFIDENCE = 0.95
MIN_ROUNDS = 2
# below this, resampling has too few distinct samples to say anything (with 2 rounds every studentized resample
# is the original), so the interval is unbounded and the verdict inconclusive: a smoke run is never judged
INTERVAL_ROUNDS = 5
VERDICTS = ("met", "missed", "inconclusive")


@dataclass(frozen=True)
class Estimate:
    """A geometric-mean ratio with the bounds of its confidence interval."""

    ratio: float
    low: float
    high: float


def paired_ratio(subject: Sequence[float], peer: Sequence[float]) -> Estimate:
    """The geometric mean of the paired ratios ``subject[i] / peer[i]`` and its bootstrap 95% interval."""
    if len(subject) != len(peer):
        raise ValueError(f"paired rounds need as many subject figures as peer figures: {len(subject)} != {len(peer)}")
    if len(subject) < MIN_ROUNDS:
        raise ValueError(f"a comparison needs at least {MIN_ROUNDS} paired rounds, got {len(subject)}")
    if any(not (x > 0 and math.isfinite(x)) for x in (*subject, *peer)):
        raise ValueError(f"every figure must be a positive, finite time: {list(subject)} / {list(peer)}")
    logs = [math.log(s / p) for s, p in zip(subject, peer, strict=True)]
    low, high = interval(logs)
    return Estimate(math.exp(statistics.fmean(logs)), math.exp(low), math.exp(high))


def interval(values: Sequence[float], *, percentile: bool = False) -> tuple[float, float]:
    """The bootstrap 95% interval of the mean of ``values``: studentized, or the plain percentile interval."""
    n, mean = len(values), statistics.fmean(values)
    if n < INTERVAL_ROUNDS:
        return -math.inf, math.inf
    spread = statistics.stdev(values)
    if spread == 0:  # every round gave the same ratio: nothing to resample
        return mean, mean
    rng = random.Random(SEED)
    tail = (1 - CONFIDENCE) / 2
    if percentile:
        means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(RESAMPLES))
        return means[int(tail * RESAMPLES)], means[math.ceil((1 - tail) * RESAMPLES) - 1]
    # each resample's mean, standardised by its own standard error; a resample of one repeated value has
    # none and is drawn again
    t: list[float] = []
    while len(t) < RESAMPLES:
        sample = rng.choices(values, k=n)
        if len(set(sample)) == 1:
            continue
        sample_mean = sum(sample) / n
        sd = math.sqrt(sum((x - sample_mean) ** 2 for x in sample) / (n - 1))  # statistics.stdev is 30x slower
        t.append((sample_mean - mean) / (sd / math.sqrt(n)))
    t.sort()
    error = spread / math.sqrt(n)
    return mean - t[math.ceil((1 - tail) * RESAMPLES) - 1] * error, mean - t[int(tail * RESAMPLES)] * error


def verdict(estimate: Estimate, max_ratio: float) -> str:
    """``met``, ``missed`` or ``inconclusive``: where the interval lies against the largest acceptable ratio."""
    if estimate.high <= max_ratio:
        return "met"
    return "missed" if estimate.low > max_ratio else "inconclusive"


def alternating(names: Sequence[str], round_: int) -> list[str]:
    """The order contenders run in, in round ``round_``: as given in even rounds, reversed in odd ones."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def interleaved_rounds(fns: dict[str, Callable[[], object]], *, rounds: int, warmup: int = 1,
                       calls: int = 1) -> dict[str, list[float]]:
    """Per contender, one figure per round: the mean wall time of ``calls`` calls, contenders alternating.

    Every contender is called ``warmup`` times first, untimed.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    figures: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(rounds):
        for name in alternating(list(fns), round_):
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            figures[name].append((time.perf_counter() - start) / calls)
    return figures


def coverage(rounds: int, *, percentile: bool = False, trials: int = 1000, spread: float = 0.05,
             seed: int = 1) -> float:
    """How often the interval holds the true mean (0) of ``rounds`` log-ratios drawn normal with sd ``spread``:
    what the nominal 95% is worth at a given number of rounds."""
    rng = random.Random(seed)
    held = 0
    for _ in range(trials):
        low, high = interval([rng.gauss(0.0, spread) for _ in range(rounds)], percentile=percentile)
        held += low <= 0.0 <= high
    return held / trials


if __name__ == "__main__":  # python -m bench.stats: the interval's real coverage at the round counts the bench uses
    for n in (5, 6, 8, 10, 15):
        print(f"{n:>2} rounds, 1000 trials: the 95% interval holds the true ratio in {coverage(n):.1%} "
              f"(studentized; percentile: {coverage(n, percentile=True):.1%})", flush=True)
