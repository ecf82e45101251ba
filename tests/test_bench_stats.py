"""The statistic every benchmark is judged by (``bench/stats.py``) and the runner's count of targets."""

from __future__ import annotations

import math

import pytest

from bench.__main__ import tally
from bench.common import Comparison
from bench.stats import Estimate, alternating, interleaved_rounds, interval, paired_ratio, verdict


def test_the_estimate_is_the_geometric_mean_of_the_per_round_ratios():
    estimate = paired_ratio([2.0, 1.0, 4.0, 2.0, 1.0], [1.0] * 5)
    assert math.isclose(estimate.ratio, 2 ** 0.8)  # (2 * 1 * 4 * 2 * 1) ** (1/5)
    assert estimate.low < estimate.ratio < estimate.high


def test_too_few_rounds_give_an_unbounded_interval_so_never_a_verdict():
    estimate = paired_ratio([0.5, 0.5, 0.5, 0.5], [1.0] * 4)
    assert estimate.ratio == 0.5 and (estimate.low, estimate.high) == (0.0, math.inf)
    assert verdict(estimate, max_ratio=1.0) == "inconclusive"


def test_the_studentized_interval_is_wider_than_the_percentile_one_at_few_rounds():
    # the percentile interval covers too rarely at 6-10 rounds; python -m bench.stats measures by how much
    logs = [0.02, -0.05, 0.01, 0.07, -0.01, 0.03]
    low, high = interval(logs)
    p_low, p_high = interval(logs, percentile=True)
    assert low < p_low < p_high < high


def test_pairing_cancels_what_moves_both_contenders_alike():
    # the machine slows down tenfold between rounds; devshim is 0.8x its peer in every round
    peer = [1.0, 10.0, 3.0, 0.5, 2.0]
    estimate = paired_ratio([0.8 * p for p in peer], peer)
    assert math.isclose(estimate.ratio, 0.8) and math.isclose(estimate.low, 0.8) and math.isclose(estimate.high, 0.8)


def test_the_interval_is_reproducible_and_widens_with_the_spread():
    tight = paired_ratio([1.00, 1.01, 0.99, 1.00, 1.02, 0.98], [1.0] * 6)
    wide = paired_ratio([1.0, 1.3, 0.7, 1.0, 1.5, 0.6], [1.0] * 6)
    assert paired_ratio([1.0, 1.3, 0.7, 1.0, 1.5, 0.6], [1.0] * 6) == wide  # a fixed seed: same figures, same CI
    assert wide.high - wide.low > 10 * (tight.high - tight.low)
    assert tight.low < 1.0 < tight.high


@pytest.mark.parametrize(("low", "high", "expected"), [(0.80, 0.95, "met"), (0.90, 1.00, "met"),
                                                       (1.01, 1.20, "missed"), (0.95, 1.05, "inconclusive")])
def test_the_verdict_is_where_the_whole_interval_lies(low, high, expected):
    assert verdict(Estimate((low + high) / 2, low, high), max_ratio=1.0) == expected


@pytest.mark.parametrize(("subject", "peer", "message"), [
    ([1.0, 2.0], [1.0], "as many"), ([1.0], [1.0], "at least 2"), ([1.0, 0.0], [1.0, 1.0], "positive"),
    ([1.0, math.nan], [1.0, 1.0], "positive")])
def test_figures_that_cannot_be_paired_are_refused(subject, peer, message):
    with pytest.raises(ValueError, match=message):
        paired_ratio(subject, peer)


def test_contenders_take_turns_going_first():
    calls: list[str] = []
    figures = interleaved_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                 rounds=4, warmup=0)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [len(v) for v in figures.values()] == [4, 4] and all(t > 0 for v in figures.values() for t in v)
    assert alternating(["x", "y", "z"], 1) == ["z", "y", "x"]


def _row(case: str, judged: bool = True) -> dict:
    return Comparison("g", case, "devshim", [1.0, 1.1, 1.0, 1.1, 1.0], "peer", [1.0] * 5, 1.05, "≤ 1.05×",
                      judged=judged).as_json()


def test_only_judged_comparisons_count_as_targets_and_each_once():
    assert tally([_row("a"), _row("b"), _row("c", judged=False)]) == {
        "judged": 2, "met": 0, "missed": 0, "inconclusive": 2}
    assert _row("c", judged=False)["verdict"] == "informational"
    with pytest.raises(ValueError, match="judged twice"):
        tally([_row("a"), _row("a")])
