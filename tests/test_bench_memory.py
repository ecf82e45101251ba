"""Spec: ``bench.attention.peak_bytes``, the peak-memory figure next to each attention time, and
``bench.attention.memory_judgement``, the rule it is judged by (devshim's peak <= 1.00x the peer's)."""

from __future__ import annotations

import torch

from bench.attention import memory_judgement, peak_bytes

MiB = 1 << 20


def test_the_peak_is_the_most_held_at_once_not_the_total_allocated():
    def call() -> None:
        a = torch.ones(4 * MiB // 4)  # 4 MiB
        del a
        b = torch.ones(2 * MiB // 4)  # then 2 MiB: 6 MiB allocated in all, never more than 4 at once
        c = torch.ones(1 * MiB // 4)  # 3 MiB held together
        del b, c

    assert 4 * MiB <= peak_bytes(call) < 4 * MiB + 64 * 1024


def test_what_existed_before_the_call_does_not_count():
    before = torch.ones(8 * MiB // 4)
    peak = peak_bytes(lambda: torch.ones(MiB // 4).sum())
    assert MiB <= peak < 2 * MiB
    del before


def test_a_forward_and_backward_counts_outputs_gradients_and_what_autograd_saved():
    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB
    weight = torch.randn(1024, 1024, requires_grad=True)  # 4 MiB

    def step() -> None:
        y = torch.tanh(x @ weight)  # y (1 MiB) is saved for tanh's backward, x @ weight's output is not kept
        torch.autograd.grad(y.sum(), (x, weight))  # + gradients: 1 MiB for x, 4 MiB for weight

    assert peak_bytes(step) >= 6 * MiB


def test_the_memory_rule_is_met_at_or_below_the_peers_peak_and_missed_above_it():
    assert memory_judgement(3 * MiB, 4 * MiB) == {"peak_memory_ratio": 0.75, "memory_max_ratio": 1.0,
                                                  "memory_verdict": "met"}
    assert memory_judgement(4 * MiB, 4 * MiB)["memory_verdict"] == "met"  # equal memory meets it
    above = memory_judgement(4 * MiB + 1, 4 * MiB)
    assert above["peak_memory_ratio"] > 1.0 and above["memory_verdict"] == "missed"
    assert memory_judgement(1, 0)["memory_verdict"] == "missed"  # more than a peer that allocated nothing
