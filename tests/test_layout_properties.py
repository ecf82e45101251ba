"""Properties of the layout conversions and of varlen packing, over generated shapes and sequence lengths."""

from __future__ import annotations

import devshim_kernels as K
import torch
from devshim_kernels.layouts import DENSE_LAYOUTS, convert_layout, from_bnsd, to_bnsd
from devshim_kernels.varlen import cu_seqlens_from_lengths, pack, padding_mask, seq_lengths, unpack
from hypothesis import given, settings
from hypothesis import strategies as st

FEW = settings(max_examples=30, deadline=None)  # a few seconds for the whole file

dims = st.integers(1, 4)
layouts = st.sampled_from(DENSE_LAYOUTS)
lengths_lists = st.lists(st.integers(0, 6), min_size=1, max_size=5)


def bnsd(b, n, s, d, seed=0):
    return torch.randn(b, n, s, d, generator=torch.Generator().manual_seed(seed))


@FEW
@given(b=dims, n=dims, s=dims, d=dims, source=layouts, target=layouts)
def test_converting_between_layouts_keeps_every_element_and_round_trips(b, n, s, d, source, target):
    logical = bnsd(b, n, s, d)
    x = from_bnsd(logical, source)
    moved = convert_layout(x, source, target, num_heads=n)
    assert torch.equal(to_bnsd(moved, target, d), logical)
    assert torch.equal(convert_layout(moved, target, source, num_heads=n), x)


@FEW
@given(b=dims, n=dims, s=dims, d=dims, layout=layouts)
def test_reading_any_layout_as_bnsd_is_a_view_not_a_copy(b, n, s, d, layout):
    x = from_bnsd(bnsd(b, n, s, d), layout)
    view = to_bnsd(x, layout, d)
    assert view.shape == (b, n, s, d) and view.data_ptr() == x.data_ptr()


@FEW
@given(lengths=lengths_lists, extra=st.integers(0, 3), features=st.integers(1, 3))
def test_pack_and_unpack_are_inverse_on_the_real_tokens(lengths, extra, features):
    width = max(lengths) + extra
    padded = torch.randn(len(lengths), width, features) * padding_mask(lengths, width)[..., None]  # zero padding
    packed, cu = pack(padded, lengths)
    assert packed.shape == (sum(lengths), features)
    assert cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert torch.equal(unpack(packed, cu, max_len=width), padded)
    assert torch.equal(pack(unpack(packed, cu), lengths)[0], packed)


@FEW
@given(lengths=lengths_lists)
def test_both_spellings_of_cumulative_lengths_describe_the_same_sequences(lengths):
    with_zero = cu_seqlens_from_lengths(lengths)
    vendor = with_zero[1:]  # Ascend's actual_seq_qlen drops the leading zero
    nonempty = [n for n in lengths if n]
    assert [n for n in seq_lengths(with_zero) if n] == nonempty
    assert [n for n in seq_lengths(vendor) if n] == nonempty
    assert sum(seq_lengths(vendor)) == sum(lengths)


@FEW
@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4), causal=st.booleans(),
       kv_heads=st.sampled_from([1, 2]))
def test_attention_on_packed_sequences_equals_padded_attention_with_a_key_padding_mask(lengths, causal, kv_heads):
    """The TND result is what a padded batch gives when padding keys are masked out, read back at real tokens."""
    width, n, d = max(lengths), 2, 4
    gen = torch.Generator().manual_seed(sum(lengths))
    q, k, v = (torch.randn(len(lengths), width, heads, d, generator=gen) for heads in (n, kv_heads, kv_heads))
    keys = padding_mask(lengths, width)[:, None, None, :]  # [B, 1, 1, S]: True = real key
    padded_out = K.attention(q, k, v, layout="BSND", attn_mask=keys, causal=causal)
    packed = [pack(t, lengths)[0] for t in (q, k, v)]
    cu = cu_seqlens_from_lengths(lengths)
    out = K.attention(*packed, layout="TND", causal=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    torch.testing.assert_close(out, pack(padded_out, lengths)[0], atol=1e-5, rtol=1e-5)
