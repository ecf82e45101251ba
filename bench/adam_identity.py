"""How exactly devshim's host Adam reproduces ``torch._fused_adamw_`` / ``torch._fused_adam_`` in fp32: a check, not
a timing (``tests/test_adam_kernels.py`` asserts what this reports).

For each implementation of ``devshim_kernels.host_adam_step`` (the native kernel as this CPU runs it, its portable
C loop, PyTorch's kernels), each mode (AdamW and Adam, with and without amsgrad) and each of ``SIZES`` (odd sizes,
none a multiple of a vector width but two), both optimizers take ``STEPS`` steps from the same fp32 values with
the same gradients (magnitudes 1e-2 to 1e2) and a learning rate changing each step. Then params, exp_avg and
exp_avg_sq are compared element by element, in two parts:

- the body: every element before the last ``numel % W``, where W is the float width of torch's vectorized CPU
  kernel on this machine (8 with AVX2, 16 with AVX-512). The claim is that these are equal bit for bit;
- the tail: torch's kernel computes the last ``numel % W`` elements with scalar code that the compiler
  contracts into fused multiply-adds differently, so exp_avg_sq there can round differently by an ulp, which
  then reaches the param. Reported: the largest relative difference after ``STEPS`` steps.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bench.common import Note, Result

SIZES = (1, 7, 31, 33, 127, 1000, 4099, 65537, 100_003)
STEPS = 120
PATHS = {"native": None, "native-generic": "generic", "torch": "0"}  # the setting of DEVSHIM_KERNELS_NATIVE
MODES = tuple(itertools.product((True, False), (False, True)))  # (adamw, amsgrad)
HYPER = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}


def vector_width() -> int:
    """Floats per vector in torch's CPU kernels here (``at::vec::Vectorized<float>::size()``)."""
    return 16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else 8


@contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """Run ``devshim_kernels``' Adam on ``path`` (one of ``PATHS``) inside the block."""
    from devshim_kernels.adam import NATIVE_SWITCH

    setting, before = PATHS[path], os.environ.pop(NATIVE_SWITCH, None)
    if setting is not None:
        os.environ[NATIVE_SWITCH] = setting
    try:
        yield
    finally:
        os.environ.pop(NATIVE_SWITCH, None)
        if before is not None:
            os.environ[NATIVE_SWITCH] = before


def compare(numel: int, adamw: bool, amsgrad: bool, steps: int = STEPS) -> dict[str, Any]:
    """devshim's host Adam against torch's fused one on ``numel`` fp32 params for ``steps`` steps."""
    import devshim_kernels

    generator = torch.Generator().manual_seed(numel)
    ours = {"param": torch.randn(numel, generator=generator), "exp_avg": torch.zeros(numel),
            "exp_avg_sq": torch.zeros(numel), "max_exp_avg_sq": torch.zeros(numel)}
    theirs = {name: tensor.clone() for name, tensor in ours.items()}
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=generator) * 10.0 ** (step % 5 - 2)
        lr = 1e-3 * (1 + 0.01 * step)
        devshim_kernels.host_adam_step(ours["param"], grad, ours["exp_avg"], ours["exp_avg_sq"], step=step, lr=lr,
                                       adamw_mode=adamw, bias_correction=True,
                                       max_exp_avg_sq=ours["max_exp_avg_sq"] if amsgrad else None, **HYPER)
        fused([theirs["param"]], [grad.clone()], [theirs["exp_avg"]], [theirs["exp_avg_sq"]],
              [theirs["max_exp_avg_sq"]] if amsgrad else [], [torch.tensor(float(step))], lr=lr, amsgrad=amsgrad,
              maximize=False, **HYPER)
    body = numel - numel % vector_width()
    names = ("param", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    tail = [((ours[n][body:] - theirs[n][body:]).abs() / theirs[n][body:].abs().clamp_min(1e-30)).max().item()
            for n in names if numel > body]
    return {"body_identical": all(torch.equal(ours[n][:body], theirs[n][:body]) for n in names),
            "tail_max_relative": max(tail, default=0.0), "tail_elements": numel - body}


def run(quick: bool = False) -> list[Result]:
    sizes, steps = (SIZES[:5], 20) if quick else (SIZES, STEPS)
    found: list[Result] = []
    for path in PATHS:
        with kernel_path(path):
            cases = [compare(n, adamw, amsgrad, steps) for n in sizes for adamw, amsgrad in MODES]
        identical = sum(c["body_identical"] for c in cases)
        found.append(Note("adam_identity", f"{path}: cases whose body equals torch's fused Adam bit for bit "
                                           f"({len(sizes)} sizes x 4 modes, {steps} steps, W={vector_width()})",
                          float(identical), f"of {len(cases)}"))
        found.append(Note("adam_identity", f"{path}: largest relative difference in the last numel % W elements",
                          max(c["tail_max_relative"] for c in cases) * 1e6, "ppm"))
    return found
