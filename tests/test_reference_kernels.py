"""The cpu_reference plugin serves devshim_kernels: each op against the math written out."""

from __future__ import annotations

import math

import devshim_kernels as K
import pytest
import torch


def naive_attention(q, k, v, keep=None, causal=False, scale=None):
    """[B, N, S, D] attention written out, with GQA by repeating key/value heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_in_every_dense_layout_matches_the_math(layout, kv_heads):
    torch.manual_seed(0)
    b, n, s, d = 2, 4, 8, 16
    q, k, v = torch.randn(b, n, s, d), torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    expected = naive_attention(q, k, v, causal=True)
    pack = {"BNSD": lambda x: x, "BSND": lambda x: x.transpose(1, 2),
            "BSH": lambda x: x.transpose(1, 2).flatten(2), "SBH": lambda x: x.permute(2, 0, 1, 3).flatten(2)}[layout]
    out = K.attention(pack(q), pack(k), pack(v), layout=layout, num_heads=n, causal=True)
    torch.testing.assert_close(out, pack(expected), atol=1e-5, rtol=1e-5)


def test_boolean_masks_in_both_polarities_mean_the_same_attention():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    keep = torch.rand(1, 1, 6, 6) > 0.3
    keep[..., 0] = True  # every query keeps at least one key
    expected = naive_attention(q, k, v, keep=keep)
    torch.testing.assert_close(K.attention(q, k, v, attn_mask=keep), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(K.attention(q, k, v, attn_mask=~keep, mask_true_means_masked=True), expected,
                               atol=1e-5, rtol=1e-5)


def test_packed_varlen_attention_equals_attention_per_sequence():
    torch.manual_seed(2)
    lengths, n, d = [3, 5, 2], 2, 8
    q, k, v = (torch.randn(sum(lengths), n, d) for _ in range(3))
    cu = torch.tensor(lengths).cumsum(0)  # vendor style [3, 8, 10]
    out = K.attention(q, k, v, layout="TND", causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    start = 0
    for length in lengths:
        seg = slice(start, start + length)
        per_seq = naive_attention(*(t[seg].transpose(0, 1)[None] for t in (q, k, v)), causal=True)
        torch.testing.assert_close(out[seg], per_seq[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        start += length


def test_rms_norm_swiglu_and_rotary_match_their_definitions():
    torch.manual_seed(3)
    x, w = torch.randn(2, 5, 16), torch.randn(16)
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    a, b = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    torch.testing.assert_close(K.swiglu(torch.cat((a, b), -1)), a * torch.sigmoid(a) * b)
    angles = torch.randn(5, 1, 1, 8)
    cos, sin = angles.cos(), angles.sin()
    xs = torch.randn(5, 2, 3, 8)  # SBND
    half = torch.cat((-xs[..., 4:], xs[..., :4]), -1)
    torch.testing.assert_close(K.rotary(xs, cos, sin), xs * cos + half * sin)
    inter = torch.stack((-xs[..., 1::2], xs[..., 0::2]), -1).flatten(-2)
    torch.testing.assert_close(K.rotary(xs, cos, sin, interleaved=True), xs * cos + inter * sin)


def test_rotary_is_an_isometry_per_pair():
    """Rotation preserves the norm of every rotated pair: a check independent of the formula above."""
    x = torch.randn(3, 4, 8)
    angles = torch.randn(3, 1, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    out = K.rotary(x, cos, sin)
    torch.testing.assert_close(out[..., :4] ** 2 + out[..., 4:] ** 2, x[..., :4] ** 2 + x[..., 4:] ** 2)


def test_fused_ops_have_gradients_that_gradcheck():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: K.rms_norm(x, w, 1e-6), (x, w))
    assert torch.autograd.gradcheck(K.swiglu, (x,))


def test_rotary_and_attention_have_gradients_that_gradcheck():
    x = torch.randn(3, 2, 1, 4, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(3, 1, 1, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: K.rotary(x, angles.cos(), angles.sin()), (x,))
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: K.attention(q, k, v, causal=True), (q, k, v))
