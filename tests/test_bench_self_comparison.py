"""Spec: no benchmark row that times a kernel against itself is judged.

Each kernel benchmark records which operators do each contender's work (``bench.kernel_calls.kernels_run``). A
row whose two sides run the same ones is informational; a judged one is refused where it is built
(``Comparison``) and where it is rendered (``python -m bench.report``).
"""

from __future__ import annotations

import devshim_kernels as K
import pytest
import torch
import torch.nn.functional as F

from bench.common import Comparison
from bench.kernel_calls import forward_backward, forward_only, kernels_of, kernels_run
from bench.report import refuse_self_comparisons

ROUNDS = [1.0, 1.1, 0.9]


def test_a_judged_row_whose_contenders_run_the_same_kernels_cannot_be_built():
    with pytest.raises(ValueError, match=r"both run aten::x.*informational"):
        Comparison("g", "case", "devshim", ROUNDS, "peer", ROUNDS, 1.0, "t", subject_kernels=("aten::x",),
                   peer_kernels=("aten::x",))
    informational = Comparison("g", "case", "devshim", ROUNDS, "peer", ROUNDS, 1.0, "t", judged=False,
                               subject_kernels=("aten::x",), peer_kernels=("aten::x",))
    assert informational.verdict == "informational"
    judged = Comparison("g", "case", "devshim", ROUNDS, "peer", ROUNDS, 1.0, "t", subject_kernels=("aten::x",),
                        peer_kernels=("aten::y",))
    assert judged.verdict != "informational"


def test_the_report_refuses_recorded_results_with_a_judged_self_comparison():
    row = Comparison("g", "case", "devshim", ROUNDS, "peer", ROUNDS, 1.0, "t", subject_kernels=("aten::x",),
                     peer_kernels=("aten::y",)).as_json()
    refuse_self_comparisons({"comparisons": [row]})  # different kernels: fine
    row["peer_kernels"] = ["aten::x"]  # as a results.json edited by hand, or written by an older bench
    with pytest.raises(SystemExit, match="time a kernel against itself"):
        refuse_self_comparisons({"comparisons": [row]})


def test_devshims_attention_forward_without_grad_is_sdpa_itself_so_that_row_is_informational():
    q, k, v = (torch.randn(1, 4, 256, 64) for _ in range(3))
    ours = kernels_run(forward_only(lambda: K.attention(q, k, v, causal=True)))
    sdpa = kernels_run(forward_only(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    assert ours == sdpa and ours


def test_the_kernels_of_different_work_differ():
    x = torch.randn(512, 512, requires_grad=True)
    grad = torch.randn(512, 512)
    matmul = kernels_run(forward_backward(lambda: x @ x, (x,), grad))
    softmax = kernels_run(forward_backward(lambda: torch.softmax(x, -1), (x,), grad))
    assert matmul and softmax and matmul != softmax


def test_contenders_decided_together_agree_on_an_op_near_the_threshold_and_tell_an_added_copy_apart():
    """``kernels_of``: a working kernel of any contender counts for every contender that spends 1% on it, so the
    same work gets the same answer whichever side of 5% a small op falls on in one profile; a contender whose own
    extra op takes 5% of its time (a layout copy) does other work."""
    q, k, v = (torch.randn(1, 4, 512, 64) for _ in range(3))
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    big = torch.randn(4, 512, 2048)
    copied = lambda: (sdpa(), big.transpose(1, 2).contiguous())  # noqa: E731
    found = kernels_of({"devshim": forward_only(lambda: K.attention(q, k, v, causal=True)),
                        "sdpa": forward_only(sdpa), "sdpa and a copy": forward_only(copied)})
    assert found["devshim"] == found["sdpa"] and found["sdpa"]
    assert set(found["sdpa and a copy"]) > set(found["sdpa"])
