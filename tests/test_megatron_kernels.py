"""masked_softmax and wgrad_accumulate, the two kernels Megatron needs beyond attention/rms_norm/swiglu/rotary:
each against the PyTorch expression Megatron computes (fp64 references; fp32 within 1e-6, fp16/bf16 within one or
two units in the last place of the output dtype), forward and backward; and the plugins that answer them."""

from __future__ import annotations

import devshim_kernels as K
import pytest
import torch
from devshim_kernels import wgrad

from devshim_core.device import build_device
from devshim_core.plugins import discover
from devshim_core.selection import select
from devshim_core.settings import Settings

# fp32 differs from the fp64 reference by rounding only; fp16/bf16 outputs by one or two rounding steps of the dtype
TOL = {torch.float32: {"atol": 1e-6, "rtol": 1e-5}, torch.float16: {"atol": 1e-3, "rtol": 1e-3},
       torch.bfloat16: {"atol": 8e-3, "rtol": 1.6e-2}}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])


def randn(*shape, dtype=torch.float32, seed=0, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


def random_mask(*shape, seed=1, p=0.3):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


def megatron_unfused_softmax(scores, mask, scale):
    """FusedScaleMaskSoftmax.forward_torch_softmax with softmax_in_fp32, in fp64: scale, fill -10000.0, softmax."""
    x = scores.double() * scale
    if mask is not None:
        x = x.masked_fill(mask, -10000.0)
    return torch.softmax(x, dim=-1)


# --- masked_softmax ----------------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("mask_shape", [(2, 1, 8, 12), (8, 12), None], ids=["b1ss", "ss", "no-mask"])
def test_masked_softmax_is_megatrons_scale_fill_softmax_forward_and_backward(mask_shape, dtype):
    scores = randn(2, 3, 8, 12, dtype=dtype, grad=True)
    mask = random_mask(*mask_shape) if mask_shape else None
    if mask is not None:
        mask[..., 0] = False  # every row keeps a key: the fully masked row has its own spec below
    got = K.masked_softmax(scores, mask, 0.7)
    ref_scores = scores.detach().double().requires_grad_()
    want = megatron_unfused_softmax(ref_scores, mask, 0.7)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want.to(dtype), **TOL[dtype])

    grad_out = randn(*got.shape, seed=5)
    (got_grad,) = torch.autograd.grad(got, scores, grad_out.to(dtype))
    (want_grad,) = torch.autograd.grad(want, ref_scores, grad_out.double())
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad, want_grad.to(dtype), **TOL[dtype])


def test_masked_positions_get_exactly_zero_probability_and_zero_gradient():
    scores, mask = randn(1, 2, 4, 6, grad=True), random_mask(1, 1, 4, 6)
    mask[..., 0] = False
    probs = K.masked_softmax(scores, mask, 1.0)
    (grad,) = torch.autograd.grad(probs, scores, randn(1, 2, 4, 6, seed=3))
    assert torch.all(probs.masked_select(mask.expand_as(probs)) == 0)
    assert torch.all(grad.masked_select(mask.expand_as(grad)) == 0)


def test_fill_is_minus_ten_thousand_not_minus_infinity_like_megatron():
    """A key whose scaled score is below -10000 loses to a masked one, in Megatron's paths and here."""
    scores = torch.tensor([[[[-20000.0, 0.0]]]])
    probs = K.masked_softmax(scores, torch.tensor([[[[False, True]]]]), 1.0)
    torch.testing.assert_close(probs, torch.tensor([[[[0.0, 1.0]]]]))


def test_causal_masks_keys_after_the_query_and_combines_with_a_mask():
    scores = randn(2, 2, 5, 5, grad=True)
    upper = torch.ones(5, 5, dtype=torch.bool).triu(1)
    torch.testing.assert_close(K.masked_softmax(scores, None, 0.5, causal=True),
                               megatron_unfused_softmax(scores.detach(), upper, 0.5).float())
    padding = torch.zeros(2, 1, 5, 5, dtype=torch.bool)
    padding[1, ..., 1] = True  # batch 1 may not attend to key 1
    torch.testing.assert_close(K.masked_softmax(scores, padding, 0.5, causal=True),
                               megatron_unfused_softmax(scores.detach(), padding | upper, 0.5).float())


def test_a_fully_masked_row_is_zeros_with_zero_gradient_as_megatrons_cuda_kernel():
    scores, mask = randn(1, 1, 3, 4, grad=True), torch.zeros(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = True
    probs = K.masked_softmax(scores, mask, 1.0)
    (grad,) = torch.autograd.grad(probs, scores, torch.ones_like(probs))
    assert torch.all(probs[..., 1, :] == 0) and torch.all(grad[..., 1, :] == 0)
    torch.testing.assert_close(probs.sum(-1)[..., [0, 2]], torch.ones(1, 1, 2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_scale_and_statistics_are_fp32_so_half_scores_times_scale_may_exceed_the_half_range(dtype):
    """Megatron's query-key layer scaling multiplies fp16 scores by the layer number inside the softmax."""
    scores = torch.tensor([[[[1000.0, 992.0, 0.0]]]], dtype=dtype)  # exact in fp16 and bf16
    probs = K.masked_softmax(scores, None, 100.0)  # 1e5 overflows fp16; in fp32 it is an ordinary softmax
    torch.testing.assert_close(probs, torch.tensor([[[[1.0, 0.0, 0.0]]]], dtype=dtype))


def test_integer_masks_count_nonzero_as_masked():
    scores, mask = randn(1, 1, 2, 4), torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.uint8)
    torch.testing.assert_close(K.masked_softmax(scores, mask, 1.0), K.masked_softmax(scores, mask.bool(), 1.0))


def test_masked_softmax_gradcheck_in_fp64():
    scores, mask = randn(1, 2, 3, 5, dtype=torch.float64, grad=True), random_mask(1, 1, 3, 5)
    mask[..., 0] = False
    assert torch.autograd.gradcheck(lambda s: K.masked_softmax(s, mask, 0.3, causal=True), (scores,))


@pytest.mark.parametrize(("scores", "mask", "message"), [
    (torch.zeros(2, 8, 8), None, r"\[b, np, sq, sk\]"),
    (torch.zeros(1, 1, 2, 2), torch.zeros(2, 2), "boolean mask"),
    (torch.zeros(1, 1, 2, 2), torch.zeros(3, 2, dtype=torch.bool), "does not broadcast"),
], ids=["3-D scores", "additive mask", "mask shape"])
def test_masked_softmax_refuses_what_it_does_not_mean(scores, mask, message):
    with pytest.raises(ValueError, match=message):
        K.masked_softmax(scores, mask, 1.0)


# --- wgrad_accumulate --------------------------------------------------------------------------------------------


def test_wgrad_accumulate_adds_grad_output_transposed_times_input_over_flattened_tokens():
    x, dy = randn(6, 2, 16, seed=1), randn(6, 2, 8, seed=2)
    main_grad = randn(8, 16, seed=3)
    before, storage = main_grad.clone(), main_grad.data_ptr()
    K.wgrad_accumulate(x, dy, main_grad)
    want = before.double() + dy.reshape(-1, 8).double().t() @ x.reshape(-1, 16).double()
    assert main_grad.data_ptr() == storage  # in place
    torch.testing.assert_close(main_grad, want.float(), atol=1e-5, rtol=1e-6)


def test_wgrad_accumulate_accumulates_across_calls():
    x, dy, main_grad = randn(10, 4, seed=1), randn(10, 3, seed=2), torch.zeros(3, 4)
    K.wgrad_accumulate(x, dy, main_grad)
    K.wgrad_accumulate(x, dy, main_grad)
    torch.testing.assert_close(main_grad, 2 * (dy.t() @ x))


@pytest.mark.parametrize("operands", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_operands_into_an_fp32_main_grad_are_summed_in_fp32(operands, monkeypatch):
    """wgrad_gemm_accum_fp32: the products of half operands are not rounded to half before they reach main_grad
    (several row blocks: the sum across blocks stays fp32 too)."""
    monkeypatch.setattr(wgrad, "_BLOCK_ELEMENTS", 64)
    x, dy = randn(300, 16, seed=1, dtype=operands), randn(300, 8, seed=2, dtype=operands)
    main_grad = randn(8, 16, seed=3)
    want = main_grad.double() + dy.double().t() @ x.double()
    K.wgrad_accumulate(x, dy, main_grad)
    assert main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad, want.float(), atol=1e-5, rtol=1e-5)


def test_half_main_grad_is_rounded_once_from_the_fp32_sum():
    """wgrad_gemm_accum_fp16: main_grad (bf16) + the product, computed in fp32, rounded to bf16 once."""
    x, dy = randn(64, 16, seed=1, dtype=torch.bfloat16), randn(64, 8, seed=2, dtype=torch.bfloat16)
    main_grad = randn(8, 16, seed=3, dtype=torch.bfloat16)
    want = (main_grad.double() + dy.double().t() @ x.double()).to(torch.bfloat16)
    K.wgrad_accumulate(x, dy, main_grad)
    assert main_grad.dtype == torch.bfloat16
    torch.testing.assert_close(main_grad, want, atol=0, rtol=8e-3)  # one bf16 ulp at most (2**-7)


@pytest.mark.parametrize(("x", "dy", "main_grad", "message"), [
    (torch.zeros(5, 4), torch.zeros(6, 3), torch.zeros(3, 4), "different numbers of tokens"),
    (torch.zeros(5, 4), torch.zeros(5, 3), torch.zeros(4, 3), r"not \[out, in\]"),
], ids=["tokens", "main_grad shape"])
def test_wgrad_accumulate_refuses_mismatched_shapes(x, dy, main_grad, message):
    with pytest.raises(ValueError, match=message):
        K.wgrad_accumulate(x, dy, main_grad)


# --- plugins -----------------------------------------------------------------------------------------------------


def test_the_cpu_reference_plugin_answers_both_with_devshim_kernels_and_devshim_reports_them():
    settings = Settings(forced="cpu_reference")
    registry = discover(settings)
    device = build_device(registry, select(registry, settings))
    assert device.attention.masked_softmax is K.masked_softmax
    assert device.attention.wgrad_accumulate is K.wgrad_accumulate
    reported = device.describe()["attention_kernels"]
    assert reported["masked_softmax"] is True and reported["wgrad_accumulate"] is True
