"""Spec: ``bench.attention.peak_bytes``, the peak-memory figure next to each attention time."""

from __future__ import annotations

import torch

from bench.attention import peak_bytes

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
