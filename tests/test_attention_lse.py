"""Attention with its log-sum-exp (``devshim_kernels.attention_lse``), what ring context parallelism merges blocks by.

Checked against plain PyTorch (SDPA and ``torch.logsumexp`` over the masked scores), forward and backward, and
by its use: attention over a key set split in two and merged equals attention over the whole set, in output and in
every gradient.
"""

from __future__ import annotations

import devshim_kernels as dk
import pytest
import torch
import torch.nn.functional as F
from devshim_kernels.attention_lse import attention_with_lse, keep_mask, with_lse_gradient

from devshim_core.integrations.megatron.context_parallel import merge_partial

B, HQ, S, D = 2, 4, 12, 8


def _qkv(hkv: int = HQ, s_q: int = S, s_k: int = S, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(B, h, s, D, generator=g, dtype=dtype).requires_grad_()
            for h, s in ((HQ, s_q), (hkv, s_k), (hkv, s_k))]


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("hkv", [HQ, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("masking", ["none", "causal", "mask", "mask+causal"])
def test_output_and_lse_and_their_gradients_equal_plain_pytorch(hkv: int, masking: str) -> None:
    q, k, v = _qkv(hkv)
    mask = None
    if "mask" in masking:
        mask = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(3)) > 0.7  # True = masked
        mask[..., 0] = False  # every query keeps a key (the plain reference has no zero-row convention)
    causal = "causal" in masking
    out, lse = attention_with_lse(q, k, v, attn_mask=mask, mask_true_means_masked=True, causal=causal, scale=0.3)
    keep = keep_mask(mask, True, causal, S, S, q.device)
    want_out, want_lse = _plain(q, k, v, keep, 0.3)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    weights = torch.randn_like(lse)
    got = torch.autograd.grad((out.sum() + (lse * weights).sum()), (q, k, v))
    want = torch.autograd.grad((want_out.sum() + (want_lse * weights).sum()), (q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_query_with_no_key_gets_zeros_minus_infinity_and_finite_gradients() -> None:
    q, k, v = _qkv()
    mask = torch.zeros(S, S, dtype=torch.bool)
    mask[3] = True  # query 3 may attend to nothing
    out, lse = attention_with_lse(q, k, v, attn_mask=mask, mask_true_means_masked=True)
    assert torch.all(out[:, :, 3] == 0) and torch.all(lse[:, :, 3] == float("-inf"))
    grads = torch.autograd.grad(out.sum() + lse.nan_to_num(neginf=0.0).sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][:, :, 3] == 0)


def test_the_default_scale_and_the_output_dtype_follow_attention() -> None:
    q, k, v = _qkv(dtype=torch.bfloat16)
    out, lse = attention_with_lse(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32  # fp32 statistics for half inputs
    torch.testing.assert_close(out, dk.attention(q, k, v, causal=True), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_two_key_blocks_merged_by_lse_equal_attention_over_all_keys(causal: bool) -> None:
    """Ring attention's step: a causal query block sees the earlier key block whole and its own causally."""
    q, k, v = _qkv(s_q=6, s_k=12)
    keep = torch.ones(6, 12, dtype=torch.bool)
    if causal:  # queries are positions 6..11
        keep = torch.ones(6, 12, dtype=torch.bool).tril(6)
    want_out, want_lse = _plain(q, k, v, keep, 0.35)
    first = attention_with_lse(q, k[:, :, :6], v[:, :, :6], scale=0.35)
    second = attention_with_lse(q, k[:, :, 6:], v[:, :, 6:], causal=causal, scale=0.35)
    out, lse = merge_partial(*first, *second)
    torch.testing.assert_close(out.to(q.dtype), want_out)
    torch.testing.assert_close(lse, want_lse)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(want_out.sum(), (q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.to(g.dtype), atol=1e-5, rtol=1e-5)


def test_merging_rows_with_no_key_in_either_block_stays_zero_and_finite() -> None:
    out = torch.zeros(1, 1, 2, 3, requires_grad=True)
    lse = torch.full((1, 1, 2), float("-inf"), requires_grad=True)
    merged, merged_lse = merge_partial(out, lse, torch.ones(1, 1, 2, 3), torch.tensor([[[float("-inf"), 0.0]]]))
    assert torch.equal(merged[0, 0, 0], torch.zeros(3)) and torch.equal(merged[0, 0, 1], torch.ones(3))
    assert merged_lse[0, 0, 0] == float("-inf") and merged_lse[0, 0, 1] == 0.0
    merged.sum().backward()
    assert torch.isfinite(out.grad).all() and torch.isfinite(lse.grad).all()


@pytest.mark.parametrize("hkv", [HQ, 2], ids=["mha", "gqa"])
def test_a_statistic_without_gradient_gets_the_log_sum_exps_gradient(hkv: int) -> None:
    """What a vendor kernel's detached softmax statistics get (Ascend's softmax_max/softmax_sum)."""
    q, k, _ = _qkv(hkv)
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    _, want = _plain(q, k, k, keep, 0.4)
    got = with_lse_gradient(want.detach(), q, k, keep=keep, scale=0.4)
    weights = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad((got * weights).sum(), (q, k)),
                               torch.autograd.grad((want * weights).sum(), (q, k)), atol=1e-5, rtol=1e-5)
