"""What is measured between two runs' samples of one tensor, and when that is a divergence.

The metrics are the ones msprobe users know, computed on the sampled elements (the same elements in both runs:
:func:`devshim_core.compare.dump.sample_indices`), the reference run's values as the truth:

- ``cosine``: cosine similarity of the two samples (1.0 when both are all zero);
- ``max_abs``: the largest absolute difference;
- ``max_rel``: the largest ``|a - b| / max(|b|, floor)``, where ``floor`` is ``1e-3`` of the reference sample's
  largest magnitude (so that elements near zero do not dominate);
- ``frac_rel_1e3`` and ``frac_rel_5e3``: the fraction of elements whose relative difference (same floor) exceeds
  1e-3 and 5e-3;
- ``norm_rel``: the relative difference of the two samples' norms, which catches a tensor scaled as a whole (an
  all-reduce that averages where it should sum), to which the cosine is blind.

A record diverges when its cosine, its norms or its largest relative error break the tolerance of its dtype
(:data:`TOLERANCES`, documented in docs/compare.md): both runs compute in that dtype and round differently, so bf16
and fp16 are looser than fp32. The fractions are reported, not judged.
A tensor whose shape differs between the runs diverges whatever its values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """A record is within tolerance when every bound holds."""

    min_cosine: float
    max_rel: float | None  # on the largest relative difference (None: not judged)
    max_norm_rel: float  # on the relative difference of the two samples' norms: a scale the cosine cannot see


# Two devices sum in different orders and use different fused kernels; errors grow through the layers and over the
# steps. A clean megatron-core TP 2 run on the emulated npu reached, in fp32 at step 1, max rel 0.027 and cosine
# 0.9999999995, with 1 element in 64 of a norm's gradient off by more than 5e-3: the fractions judge nothing (a few
# elements of a small tensor are a large fraction), they are reported. The planted mistakes of
# tests/e2e/test_compare_faults.py break the bounds by orders of magnitude (cosine 0.9999 and max rel 2.6 for the
# mildest, a swapped rotary half). In half precision the relative error is not judged: a norm's output subtracts its
# mean, so an element near zero carries an absolute error of the output's scale (clean bf16 runs of the examples on
# the emulated devices: max rel 13-115 on such elements, smallest cosine 0.9989); the cosine judges alone.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(min_cosine=0.999999, max_rel=1e-6, max_norm_rel=1e-6),
    "float32": Tolerance(min_cosine=0.99999, max_rel=0.1, max_norm_rel=0.01),
    "bfloat16": Tolerance(min_cosine=0.99, max_rel=None, max_norm_rel=0.05),
    "float16": Tolerance(min_cosine=0.995, max_rel=None, max_norm_rel=0.02),
}


def tolerance_of(dtype: str) -> Tolerance:
    return TOLERANCES.get(dtype, TOLERANCES["float32"])


@dataclass(frozen=True)
class Metrics:
    cosine: float
    max_abs: float
    max_rel: float
    frac_rel_1e3: float
    frac_rel_5e3: float
    norm_rel: float = 0.0

    def as_json(self) -> dict[str, float]:
        return asdict(self)

    def breaks(self, tolerance: Tolerance) -> list[str]:
        """Which bounds of ``tolerance`` these metrics break, in words (empty: within tolerance)."""
        broken = []
        if self.cosine < tolerance.min_cosine:
            broken.append(f"cosine {self.cosine:.6f} < {tolerance.min_cosine}")
        if self.norm_rel > tolerance.max_norm_rel:
            broken.append(f"norms differ by {self.norm_rel:.3g} relative > {tolerance.max_norm_rel:g}")
        if tolerance.max_rel is not None and self.max_rel > tolerance.max_rel:
            broken.append(f"max relative error {self.max_rel:.3g} > {tolerance.max_rel:g}")
        return broken


def measure(values: torch.Tensor, reference: torch.Tensor) -> Metrics:
    """The metrics of ``values`` against ``reference`` (two float32 samples of the same elements)."""
    a, b = values.double(), reference.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        same = bool(torch.equal(torch.nan_to_num(a, nan=0.5), torch.nan_to_num(b, nan=0.5)))
        return Metrics(1.0 if same else 0.0, 0.0 if same else float("inf"), 0.0 if same else float("inf"),
                       0.0 if same else 1.0, 0.0 if same else 1.0)
    diff = (a - b).abs()
    norms = a.norm() * b.norm()
    cosine = 1.0 if norms == 0 and diff.max() == 0 else float((a * b).sum() / norms) if norms > 0 else 0.0
    floor = max(float(b.abs().max()) * 1e-3, torch.finfo(torch.float32).tiny)
    relative = diff / b.abs().clamp_min(floor)
    reference_norm = float(b.norm())
    norm_rel = abs(float(a.norm()) - reference_norm) / reference_norm if reference_norm > 0 else float(a.norm() > 0)
    return Metrics(cosine=cosine, max_abs=float(diff.max()), max_rel=float(relative.max()),
                   frac_rel_1e3=float((relative > 1e-3).double().mean()),
                   frac_rel_5e3=float((relative > 5e-3).double().mean()), norm_rel=norm_rel)
