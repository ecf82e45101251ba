"""Spec: bench/fused_ops.py's bytes rule, its bandwidth figures and its moonshot against the compiled peer.

The bytes rule (the module's docstring) counts each tensor once: forward reads what the op reads and writes the
output; backward reads the upstream gradient and what the gradient depends on, and writes each input's gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

import bench.fused_ops as fo
from bench.common import Comparison


def _case(name: str, dtype: torch.dtype = torch.float32) -> tuple[fo.Case, torch.Tensor]:
    make = dict(fo._cases(quick=True))[name]
    case = make(dtype)
    with torch.no_grad():
        return case, case.plain(*case.inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bytes_rule_counts_each_tensor_once(dtype: torch.dtype) -> None:
    e = torch.empty((), dtype=dtype).element_size()
    case, out = _case("rms_norm 64x256", dtype)  # x: 64x256, weight: 256
    n, w = 64 * 256, 256
    assert fo.bytes_moved(case, out, "fwd") == (2 * n + w) * e
    assert fo.bytes_moved(case, out, "fwd+bwd") == (5 * n + 3 * w) * e
    case, out = _case("swiglu 64x2*256", dtype)  # x: 64x512 in, 64x256 out
    n = 64 * 256
    assert fo.bytes_moved(case, out, "fwd") == 3 * n * e
    assert fo.bytes_moved(case, out, "fwd+bwd") == 8 * n * e
    case, out = _case("rotary half 32x1x2x32", dtype)  # x: 32x1x2x32; cos, sin: 32x1x1x32; backward skips x
    n, c = 32 * 2 * 32, 32 * 32
    assert fo.bytes_moved(case, out, "fwd") == (2 * n + 2 * c) * e
    assert fo.bytes_moved(case, out, "fwd+bwd") == (4 * n + 4 * c) * e


def test_the_fractions_are_achieved_bandwidth_over_the_copy_bandwidth() -> None:
    details = fo.bandwidth_details(10**9, subject_seconds=0.1, peer_seconds=0.2, copy_gbps=20.0)
    assert details["bytes_moved"] == 10**9
    assert details["subject_GBps"] == 10.0 and details["peer_GBps"] == 5.0
    assert details["subject_fraction_of_copy_bandwidth"] == 0.5
    assert details["peer_fraction_of_copy_bandwidth"] == 0.25


def test_the_copy_bandwidth_is_a_positive_finite_figure() -> None:
    gbps = fo.copy_bandwidth(quick=True)
    assert gbps > 0 and math.isfinite(gbps)


def test_the_moonshot_is_judged_on_the_rows_interval_at_0_80() -> None:
    def row(ratio: float, judged: bool = True) -> Comparison:
        peer = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0]
        return Comparison("g", "c", "s", [p * ratio for p in peer], "p", peer, 1.0, "t", judged=judged)

    assert fo.moonshot(row(0.5)) == {"moonshot_max_ratio": 0.80, "moonshot": "met"}
    assert fo.moonshot(row(0.9))["moonshot"] == "missed"
    assert fo.moonshot(row(0.5, judged=False))["moonshot"] == "informational"


def test_a_peer_that_cannot_compile_is_a_note_and_no_peer() -> None:
    def breaks(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # fullgraph=True refuses any break
        return x * 2

    x = torch.randn(4, requires_grad=True)
    compiled, note = fo._compiled_peer("case", breaks, (x,), torch.ones(4))
    assert compiled is None and "did not compile" in note.name and math.isnan(note.value)
