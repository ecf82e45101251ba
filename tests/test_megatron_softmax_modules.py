"""Spec: the fused-softmax CUDA extensions Megatron imports are provided on the device's ``masked_softmax`` kernel.

Megatron-DeepSpeed imports ``scaled_masked_softmax_cuda``, ``scaled_upper_triang_masked_softmax_cuda`` and
``scaled_softmax_cuda`` inside its softmax autograd functions, with no fallback, whenever masked-softmax fusion is on
(its default) and the scores are fp16 or bf16; devshim used to block them, and every fp16/bf16 run with default
flags died with ModuleNotFoundError. Now they are modules with the CUDA extension's functions. Here they run through
megatron-core's own autograd functions (the same code as Megatron-DeepSpeed's ``fused_softmax.py``) and equal
Megatron's unfused softmax (scale, -10000.0 fill, fp32 softmax, cast back) forward and backward; a counter shows the
plugin's kernel ran; ``get_batch_per_block`` answers what the CUDA kernel's launch arithmetic gives, so Megatron's
``is_kernel_available`` takes the branch it takes on a GPU. A plugin without the kernel gets no modules: they stay
blocked, naming the flag that avoids them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from devshim_core.device import Device, build_device
from devshim_core.integrations.megatron import extension_modules, softmax_modules
from devshim_core.plugins import discover
from devshim_core.selection import select
from devshim_core.settings import Settings

pytest.importorskip("megatron.core", reason="the autograd functions that import the extensions are Megatron's")
from megatron.core.fusions import fused_softmax

CALLS: list[dict[str, Any]] = []


def _device(**replaced: Any) -> Device:
    settings = Settings(forced="cpu_reference")
    registry = discover(settings)
    base = build_device(registry, select(registry, settings))
    kernel = base.attention.masked_softmax
    assert kernel is not None

    def counted(*args: Any, **kwargs: Any) -> Any:
        CALLS.append(kwargs)
        return kernel(*args, **kwargs)

    kernels = dataclasses.replace(base.attention, **{"masked_softmax": counted, **replaced})
    return Device(base.info, base.module, base.traits, base.collectives, base.allocator, base.optimizer, kernels,
                  base.offload_io, base.patches)


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The three modules in sys.modules, where megatron's autograd functions import them."""
    made = softmax_modules.make_modules(_device())
    for name, module in made.items():
        monkeypatch.setitem(__import__("sys").modules, name, module)
    CALLS.clear()
    yield made


def unfused(scores: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Megatron's torch path: scale in fp32, masked_fill(-10000.0), softmax, back to the scores' dtype."""
    x = scores.float() * scale
    if mask is not None:
        x = x.masked_fill(mask, -10000.0)
    return torch.softmax(x, dim=-1).to(scores.dtype)


def compare(fused_fn: Any, reference_fn: Any, scores: torch.Tensor, tol: float) -> None:
    a = scores.clone().requires_grad_()
    b = scores.clone().float().requires_grad_()
    out = fused_fn(a)
    want = reference_fn(b)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    out.backward(grad)
    want.backward(grad.float())
    assert out.dtype == scores.dtype
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(a.grad.float(), b.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_softmax_through_megatrons_autograd_function(modules, dtype):
    scores = torch.randn(2, 4, 8, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    mask = torch.rand(2, 1, 8, 32, generator=torch.Generator().manual_seed(1)) < 0.3
    compare(lambda s: fused_softmax.ScaledMaskedSoftmax.apply(s, mask, 0.7),
            lambda s: unfused(s, mask, 0.7), scores, 1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert len(CALLS) == 1  # the forward ran the plugin's kernel


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_causal_softmax_through_megatrons_autograd_function(modules, dtype):
    scores = torch.randn(8, 16, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    upper = torch.ones(16, 16, dtype=torch.bool).triu(1)
    compare(lambda s: fused_softmax.ScaledUpperTriangMaskedSoftmax.apply(s, 0.5),
            lambda s: unfused(s, upper, 0.5), scores, 1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert CALLS == [{"causal": True}]


def test_unmasked_softmax_through_megatrons_autograd_function(modules):
    scores = torch.randn(2, 2, 8, 24, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    compare(lambda s: fused_softmax.ScaledSoftmax.apply(s, 1.3), lambda s: unfused(s, None, 1.3), scores, 2e-3)
    assert len(CALLS) == 1


def test_a_uint8_mask_is_read_as_cuda_reads_it(modules):
    scores = torch.randn(1, 1, 4, 20).half()
    mask = torch.zeros(1, 1, 4, 20, dtype=torch.uint8)
    mask[..., 10:] = 1
    out = modules["scaled_masked_softmax_cuda"].forward(scores, mask, 1.0)
    torch.testing.assert_close(out, unfused(scores, mask.bool(), 1.0), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(("sk", "per_block"), [(16, 16), (32, 8), (64, 8), (128, 8), (256, 4), (4096, 4)])
def test_batch_per_block_is_the_cuda_kernels(modules, sk, per_block):
    """threads_per_block 128 / min(next_pow2(sk), 32) warps, times 2 rows per warp up to 128 keys."""
    assert modules["scaled_masked_softmax_cuda"].get_batch_per_block(sk, sk, 2, 4) == per_block
    assert fused_softmax.FusedScaleMaskSoftmax.get_batch_per_block(sk, sk, 2, 4) == per_block


def test_a_plugin_without_the_kernel_gets_no_modules_and_the_block_names_the_flag():
    assert softmax_modules.make_modules(_device(masked_softmax=None)) == {}
    for name in softmax_modules.MODULE_NAMES:
        assert "--no-masked-softmax-fusion" in extension_modules.BLOCKED[name]


def test_devshims_megatron_integration_provides_them():
    assert set(softmax_modules.MODULE_NAMES) <= set(extension_modules.provided(_device()))
