"""Packed variable-length sequences (``TND``): tokens of all sequences back to back, delimited by cumulative lengths.

Two spellings of the cumulative lengths are accepted wherever they are read: with a leading zero, as
flash-attn and Megatron's ``PackedSeqParams`` write them (lengths [2, 3] -> [0, 2, 5]), and without, as Ascend's
``actual_seq_qlen`` does ([2, 5]). Helpers here always *produce* the leading-zero form.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

Tensor = torch.Tensor
CuSeqlens = Tensor | Sequence[int]


def seq_lengths(cu_seqlens: CuSeqlens, *, total: int | None = None, name: str = "cu_seqlens") -> list[int]:
    """Per-sequence lengths from cumulative lengths in either spelling; ``total`` checks the token count.

    A leading zero is read as the start offset; a zero-length first sequence in the vendor spelling would read
    the same way, which changes nothing downstream because an empty sequence holds no tokens."""
    offsets = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if not offsets:
        raise ValueError(f"{name} is empty")
    if offsets[0] != 0:
        offsets = [0, *offsets]
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing cumulative lengths, got {offsets}")
    if total is not None and offsets[-1] != total:
        raise ValueError(f"{name} ends at {offsets[-1]} but the tensor holds {total} tokens")
    return lengths


def cu_seqlens_from_lengths(lengths: Tensor | Sequence[int], *, dtype: torch.dtype = torch.int32) -> Tensor:
    """[0, l0, l0+l1, ...]: the leading-zero cumulative form (int32, as flash-attn and the vendors take it)."""
    lengths = torch.as_tensor(lengths).reshape(-1)
    return torch.cat((lengths.new_zeros(1), lengths.cumsum(0))).to(dtype)


def padding_mask(lengths: Tensor | Sequence[int], max_len: int | None = None) -> Tensor:
    """[batch, max_len] booleans, True at real tokens (the first ``lengths[b]`` of each row)."""
    lengths = torch.as_tensor(lengths).reshape(-1)
    width = int(lengths.max()) if max_len is None and len(lengths) else (max_len or 0)
    return torch.arange(width, device=lengths.device) < lengths.unsqueeze(-1)


def pack(padded: Tensor, lengths: Tensor | Sequence[int]) -> tuple[Tensor, Tensor]:
    """[batch, seq, ...] with the first ``lengths[b]`` tokens of row ``b`` real -> ([tokens, ...], cu_seqlens).

    Differentiable; BSND input gives TND output."""
    keep = padding_mask(lengths, padded.shape[1])
    if keep.shape[0] != padded.shape[0]:
        raise ValueError(f"{keep.shape[0]} lengths for a batch of {padded.shape[0]}")
    return padded[keep.to(padded.device)], cu_seqlens_from_lengths(keep.sum(-1))


def unpack(packed: Tensor, cu_seqlens: CuSeqlens, max_len: int | None = None) -> Tensor:
    """Inverse of :func:`pack`: [tokens, ...] -> [batch, max_len, ...], zero-filled past each sequence's end."""
    lengths = seq_lengths(cu_seqlens, total=packed.shape[0])
    keep = padding_mask(lengths, max_len).to(packed.device)
    if max_len is not None and lengths and max(lengths) > max_len:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit max_len {max_len}")
    out = packed.new_zeros((*keep.shape, *packed.shape[1:]))
    return out.index_put((keep,), packed)
