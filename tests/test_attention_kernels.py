"""devshim_kernels.attention: every layout, mask, causal alignment, GQA, dropout and packed varlen input
against attention written out in fp64, forward and backward."""

from __future__ import annotations

import importlib
import math

import devshim_kernels as K
import pytest
import torch
import torch.nn.functional as F
from devshim_kernels.layouts import from_bnsd, to_bnsd

attention_module = importlib.import_module("devshim_kernels.attention")  # the package's `attention` is the function

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def reference(q, k, v, *, keep=None, bias=None, causal=False, alignment="top_left", scale=None, probs_hook=None):
    """[B, N, S, D] attention in fp64: GQA by repeating key/value heads; a query with no allowed key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s_q, s_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if bias is not None:
        scores = scores + bias.double()
    allowed = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(s_k - s_q if alignment == "bottom_right" else 0)
    if keep is not None:
        allowed = allowed & keep
    any_key = allowed.any(-1, keepdim=True)
    probs = scores.masked_fill(~allowed, float("-inf")).where(any_key, 0.0).softmax(-1) * any_key
    if probs_hook is not None:
        probs = probs_hook(probs)
    return probs @ v


def leaves(*shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def assert_matches_reference(ours, inputs, expected_fn, dtype):
    """Forward and the gradients of every input agree with the fp64 reference run on the same inputs."""
    grad_out = torch.randn(ours.shape, generator=torch.Generator().manual_seed(7)).to(ours.dtype)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    expected = expected_fn(*ref_inputs)
    torch.testing.assert_close(ours, expected.to(ours.dtype), **TOL[dtype])
    for got, want in zip(grads(ours, inputs, grad_out), grads(expected, ref_inputs, grad_out.double()), strict=True):
        torch.testing.assert_close(got, want.to(got.dtype), **TOL[dtype])


def test_the_cpu_reference_plugin_serves_these_kernels():
    import devshim_cpu_reference as plugin

    kernels = plugin.devshim_attention_kernels(plugin.devshim_detect())
    assert (kernels.attention, kernels.rms_norm, kernels.swiglu, kernels.rotary) == (
        K.attention, K.rms_norm, K.swiglu, K.rotary)


# --- dense layouts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_every_layout_is_attention_of_its_bnsd_view_forward_and_backward(layout, kv_heads, dtype):
    b, n, s, d = 2, 4, 9, 16
    q, k, v = (from_bnsd(t.detach(), layout).requires_grad_()
               for t in leaves((b, n, s, d), (b, kv_heads, s, d), (b, kv_heads, s, d), dtype=dtype))
    out = K.attention(q, k, v, layout=layout, num_heads=n, causal=True)
    assert out.shape == q.shape and out.dtype == dtype

    def expected(q, k, v):
        return from_bnsd(reference(*(to_bnsd(t, layout, d) for t in (q, k, v)), causal=True), layout)

    assert_matches_reference(out, (q, k, v), expected, dtype)


@pytest.mark.parametrize("layout", ["BSND", "SBH"])
def test_inference_without_gradients_gives_the_same_attention(layout):
    q, k, v = (from_bnsd(t.detach(), layout) for t in leaves(*[(2, 4, 40, 8)] * 3))
    with torch.no_grad():
        out = K.attention(q, k, v, layout=layout, num_heads=4, causal=True)
    expected = from_bnsd(reference(*(to_bnsd(t, layout, 8) for t in (q, k, v)), causal=True), layout)
    torch.testing.assert_close(out, expected.float(), **TOL[torch.float32])


def test_causal_training_attention_longer_than_one_row_block_matches_the_math():
    """Causal fp32 training attention over 300 rows with grouped key/value heads."""
    q, k, v = leaves((1, 2, 300, 16), (1, 1, 300, 16), (1, 1, 300, 16))
    out = K.attention(q, k, v, causal=True)
    assert_matches_reference(out, (q, k, v), lambda q, k, v: reference(q, k, v, causal=True), torch.float32)


def test_default_scale_is_one_over_root_head_dim_and_an_explicit_scale_replaces_it():
    q, k, v = leaves(*[(1, 2, 5, 16)] * 3)
    torch.testing.assert_close(K.attention(q, k, v), reference(q, k, v, scale=0.25).float())
    torch.testing.assert_close(K.attention(q, k, v, scale=1.0), reference(q, k, v, scale=1.0).float())


# --- masks and causal alignment ------------------------------------------------------------------------------


def test_boolean_masks_in_either_polarity_and_integer_masks_mean_the_same_attention():
    q, k, v = leaves(*[(1, 2, 6, 8)] * 3)
    keep = torch.rand(1, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    expected = reference(q, k, v, keep=keep).float()
    torch.testing.assert_close(K.attention(q, k, v, attn_mask=keep), expected)
    torch.testing.assert_close(K.attention(q, k, v, attn_mask=~keep, mask_true_means_masked=True), expected)
    torch.testing.assert_close(K.attention(q, k, v, attn_mask=(~keep).to(torch.uint8), mask_true_means_masked=True),
                               expected)  # Ascend also takes uint8 masks


def test_a_floating_mask_is_added_to_the_scores():
    q, k, v = leaves(*[(2, 2, 5, 8)] * 3)
    bias = torch.randn(2, 1, 5, 5)
    torch.testing.assert_close(K.attention(q, k, v, attn_mask=bias), reference(q, k, v, bias=bias).float(),
                               **TOL[torch.float32])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_shape", [(7, 7), (1, 1, 7, 7), (2, 1, 1, 7), (2, 4, 7, 7), (2, 1, 7, 7)],
                         ids=["SS", "11SS", "B11S-key-padding", "BNSS", "B1SS"])
def test_vendor_mask_shapes_broadcast_and_combine_with_causal(mask_shape, causal):
    q, k, v = leaves((2, 4, 7, 8), (2, 2, 7, 8), (2, 2, 7, 8))
    masked = torch.rand(mask_shape, generator=torch.Generator().manual_seed(3)) > 0.7  # Ascend: True = masked
    out = K.attention(q, k, v, attn_mask=masked, mask_true_means_masked=True, causal=causal)
    assert_matches_reference(out, (q, k, v), lambda q, k, v: reference(q, k, v, keep=~masked, causal=causal),
                             torch.float32)


@pytest.mark.parametrize("s_q,s_k", [(3, 7), (7, 3)], ids=["fewer-queries", "more-queries"])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_alignment_when_query_and_key_lengths_differ(alignment, s_q, s_k):
    """top_left: query i sees keys j <= i (SDPA, Ascend sparse_mode=2); bottom_right: j <= i + s_k - s_q
    (flash-attn, Ascend sparse_mode=3). Queries left with no key output zeros."""
    q, k, v = leaves((1, 2, s_q, 8), (1, 2, s_k, 8), (1, 2, s_k, 8))
    out = K.attention(q, k, v, causal=True, causal_alignment=alignment)
    assert_matches_reference(out, (q, k, v), lambda q, k, v: reference(q, k, v, causal=True, alignment=alignment),
                             torch.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_query_that_may_attend_to_nothing_outputs_zero_with_zero_gradient(causal):
    q, k, v = leaves(*[(1, 1, 4, 8)] * 3)
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[2] = False
    keep[0, 0] = False  # with causal, query 0 sees key 0 only: nothing left either
    out = K.attention(q, k, v, attn_mask=keep, causal=causal)
    (dq,) = torch.autograd.grad(out.sum(), q)
    empty = [0, 2] if causal else [2]
    assert torch.equal(out[0, 0, empty], torch.zeros(len(empty), 8))
    assert torch.equal(dq[0, 0, empty], torch.zeros(len(empty), 8))
    assert out[0, 0, [1, 3]].abs().sum() > 0


def spy(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


# (kwargs for K.attention, q/k/v shapes, the kernel expected to run): every dispatch path passes gradcheck
GRADCHECK_CASES = {
    "causal-sdpa": ({"causal": True}, [(1, 2, 5, 3)] * 3, (F, "scaled_dot_product_attention")),
    "full-sdpa": ({}, [(1, 2, 5, 3)] * 3, (F, "scaled_dot_product_attention")),
    "causal+mask-flash-cpu": ({"causal": True, "attn_mask": torch.tensor([True, True, False, True, True])},
                              [(1, 2, 5, 3)] * 3, (attention_module, "_FLASH_CPU")),
    "mask-sdpa": ({"attn_mask": torch.tensor([True, True, False, True, True])}, [(1, 2, 5, 3)] * 3,
                  (F, "scaled_dot_product_attention")),
    "bottom-right-sdpa": ({"causal": True, "causal_alignment": "bottom_right"}, [(1, 2, 3, 3), (1, 2, 5, 3),
                                                                                 (1, 2, 5, 3)],
                          (F, "scaled_dot_product_attention")),
    "gqa-causal": ({"causal": True}, [(1, 4, 5, 3), (1, 2, 5, 3), (1, 2, 5, 3)], (F, "scaled_dot_product_attention")),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_in_fp64_on_every_dispatch_path(case, monkeypatch):
    kwargs, shapes, (owner, kernel) = GRADCHECK_CASES[case]
    calls = spy(monkeypatch, owner, kernel)
    inputs = [t.detach().double().requires_grad_() for t in leaves(*shapes)]
    assert torch.autograd.gradcheck(lambda q, k, v: K.attention(q, k, v, **kwargs), inputs)
    assert calls, f"{case} did not run {kernel}"


# --- packed variable-length (TND) ----------------------------------------------------------------------------


def per_sequence_reference(q, k, v, lengths_q, lengths_kv, **kwargs):
    outs, sq, sk = [], 0, 0
    for lq, lk in zip(lengths_q, lengths_kv, strict=True):
        bnsd = [t.transpose(0, 1)[None] for t in (q[sq:sq + lq], k[sk:sk + lk], v[sk:sk + lk])]
        outs.append(reference(*bnsd, **kwargs)[0].transpose(0, 1))
        sq, sk = sq + lq, sk + lk
    return torch.cat(outs)


@pytest.mark.parametrize("vendor_spelling", [False, True], ids=["leading-zero", "ascend-style"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_sequences_attend_only_within_themselves(causal, vendor_spelling):
    lengths = [3, 5, 0, 2]
    q, k, v = leaves((10, 4, 8), (10, 2, 8), (10, 2, 8))
    cu = torch.tensor(lengths).cumsum(0) if vendor_spelling else torch.tensor([0, *lengths]).cumsum(0)
    out = K.attention(q, k, v, layout="TND", causal=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert_matches_reference(out, (q, k, v),
                             lambda q, k, v: per_sequence_reference(q, k, v, lengths, lengths, causal=causal),
                             torch.float32)


def test_fixed_length_packing_is_the_batched_attention():
    q, k, v = leaves(*[(3, 6, 2, 8)] * 3)  # BSND
    packed = [t.flatten(0, 1) for t in (q, k, v)]
    out = K.attention(*packed, layout="TND", causal=True, cu_seqlens_q=torch.tensor([0, 6, 12, 18]))
    torch.testing.assert_close(out, K.attention(q, k, v, layout="BSND", causal=True).flatten(0, 1))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_packed_cross_attention_with_different_query_and_key_lengths(alignment):
    len_q, len_kv = [2, 4, 1], [5, 3, 0]  # the last queries have no keys: zeros
    q, k, v = leaves((7, 2, 8), (8, 2, 8), (8, 2, 8))
    out = K.attention(q, k, v, layout="TND", causal=True, causal_alignment=alignment,
                      cu_seqlens_q=torch.tensor(len_q).cumsum(0), cu_seqlens_kv=torch.tensor(len_kv).cumsum(0))
    assert torch.equal(out[-1], torch.zeros(2, 8))
    assert_matches_reference(out, (q, k, v), lambda q, k, v: per_sequence_reference(
        q, k, v, len_q, len_kv, causal=True, alignment=alignment), torch.float32)


def test_packed_attention_gradchecks_in_fp64():
    q, k, v = (t.detach().double().requires_grad_() for t in leaves(*[(6, 2, 3)] * 3))
    cu = torch.tensor([0, 2, 6])
    assert torch.autograd.gradcheck(
        lambda q, k, v: K.attention(q, k, v, layout="TND", causal=True, cu_seqlens_q=cu), (q, k, v))


# --- dropout -------------------------------------------------------------------------------------------------


def seeded(seed, fn, *args, **kwargs):
    torch.manual_seed(seed)
    return fn(*args, **kwargs)


def dropout_probe(layout, p, seed=0):
    """Attention whose output *is* the dropped-out probability matrix: q = 0 makes every probability 1/S,
    and v = identity copies probabilities to outputs, so out[i, j] = keep_ij / (S * (1 - p))."""
    b, n, s = 2, 4, 128
    q, k = torch.zeros(b, n, s, 16), torch.randn(b, n, s, 16)
    v = torch.eye(s).expand(b, n, s, s)
    if layout == "TND":  # b sequences of s tokens each
        q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))
        cu = torch.arange(0, (b + 1) * s, s)
        return seeded(seed, K.attention, q, k, v, layout="TND", dropout_p=p, cu_seqlens_q=cu), s
    return seeded(seed, K.attention, q, k, v, dropout_p=p), s


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_dropout_is_reproducible_under_a_seed_and_differs_across_seeds(layout):
    first, _ = dropout_probe(layout, 0.3, seed=11)
    assert torch.equal(first, dropout_probe(layout, 0.3, seed=11)[0])
    assert not torch.equal(first, dropout_probe(layout, 0.3, seed=12)[0])


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_dropout_zero_is_exactly_no_dropout(layout):
    q, k, v = leaves(*[(12, 2, 8)] * 3) if layout == "TND" else leaves(*[(1, 2, 12, 8)] * 3)
    extra = {"cu_seqlens_q": torch.tensor([0, 5, 12])} if layout == "TND" else {}
    assert torch.equal(K.attention(q, k, v, layout=layout, dropout_p=0.0, causal=True, **extra),
                       K.attention(q, k, v, layout=layout, causal=True, **extra))


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_dropout_zeroes_a_fraction_p_and_scales_survivors_to_preserve_the_expectation(layout):
    p = 0.3
    out, s = dropout_probe(layout, p)
    kept = out != 0
    # 131072 Bernoulli draws: the kept fraction's standard deviation is 0.0013, so 0.01 is > 7 sigma (and the
    # seed is fixed, so the draw is the same every run)
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (s * (1 - p))))
    assert abs(out.sum(-1).mean().item() - 1.0) < 0.015  # each row's expected total probability stays 1


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_dropout_gradients_are_those_of_the_drawn_mask(layout):
    """With the seed reset before every call the mask is fixed, so gradcheck compares the backward against
    finite differences of that very dropped-out attention."""
    if layout == "TND":
        shapes, extra = [(6, 2, 3)] * 3, {"cu_seqlens_q": torch.tensor([0, 4, 6])}
    else:
        shapes, extra = [(1, 2, 5, 3)] * 3, {}
    inputs = [t.detach().double().requires_grad_() for t in leaves(*shapes)]

    def fn(q, k, v):
        return seeded(5, K.attention, q, k, v, layout=layout, dropout_p=0.4, causal=True, **extra)

    assert torch.autograd.gradcheck(fn, inputs)
    assert all(g.abs().sum() > 0 for g in torch.autograd.grad(fn(*inputs).sum(), inputs))


# --- argument checking ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"layout": "NSD"}, "unknown layout"),
    ({"layout": "BSH"}, "needs num_heads"),
    ({"layout": "BNSD", "num_heads": 3}, "num_heads=3"),
    ({"layout": "TND"}, "needs cu_seqlens_q"),
    ({"layout": "TND", "cu_seqlens_q": [0, 2], "attn_mask": torch.ones(2, 2, dtype=torch.bool)}, "no attn_mask"),
    ({"dropout_p": 1.0}, "dropout_p"),
    ({"causal_alignment": "center"}, "causal_alignment"),
])
def test_bad_arguments_are_refused_with_a_reason(kwargs, message):
    q = torch.randn(2, 2, 4, 8) if kwargs.get("layout", "BNSD") == "BNSD" else torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match=message):
        K.attention(q, q, q, **kwargs)


def test_cumulative_lengths_must_cover_the_tokens_and_key_heads_must_divide_query_heads():
    q = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="ends at 4"):
        K.attention(q, q, q, layout="TND", cu_seqlens_q=[0, 4])
    with pytest.raises(ValueError, match="not a multiple"):
        K.attention(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
