"""Context parallelism in megatron-core's local attention, on the plugin's kernels, without TransformerEngine.

Megatron splits each sequence over the context-parallel (CP) ranks load-balanced for causal masks: the sequence is
cut into ``2 * cp`` chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (``get_batch_on_this_cp_rank``,
and the rotary embedding's ``get_pos_emb_on_this_cp_rank``). Its local ``DotProductAttention`` asserts CP off; TE's
attention serves it on CUDA. Here the same ``cp_comm_type`` values run on any device:

- ``a2a`` (Ulysses, MindSpeed's ``ulysses_cp_algo``): an all-to-all trades the sequence split for a head split, the
  plugin's attention runs on whole sequences for ``heads / cp`` heads, and a second all-to-all trades back.
- ``p2p`` (ring attention, MindSpeed's ``megatron_cp_algo``; ``all_gather`` is served by the same ring): the key/value
  blocks travel around the ranks; each rank attends its queries to every block with the plugin's ``attention_lse``
  and merges the partial results by their log-sum-exps (online softmax).
- ``a2a+p2p`` (MindSpeed's ``hybrid_cp_algo``; ``hierarchical_context_parallel_sizes`` = [a2a size, ring size]):
  Ulysses within the first level, ring attention across the second.

Which key a query may attend to is decided by the global positions each rank holds (a causal mask keeps position
``j <= i``), so any split is right whatever order the chunks arrive in. Everything is differentiable: the
all-to-alls and the ring's transfers have their own backward (the transposed communication).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor
# Megatron's cp_comm_type spellings (TransformerConfig says all_gather, Megatron-LM's --cp-comm-type allgather)
RING = ("p2p", "all_gather", "allgather")
ULYSSES = ("a2a",)
HYBRID = ("a2a+p2p",)
COMM_TYPES = RING + ULYSSES + HYBRID
_TAG = 0x5CF  # the ring's transfers, apart from any other point-to-point traffic on the group

# (query [s, b, n, d], key, value [s, b, ng, d], keep-mask or None, causal) -> context [s, b, n, d]
LocalAttention = Callable[[Tensor, Tensor, Tensor, "Tensor | None", bool], Tensor]
# (q, k, v [b, n, s, d], attn_mask=keep, causal=..., scale=..., dropout_p=...) -> (out, lse)
LseAttention = Callable[..., "tuple[Tensor, Tensor]"]


def load_balanced_positions(local_len: int, cp_size: int, cp_rank: int, device: torch.device) -> Tensor:
    """The global positions of the tokens CP rank ``cp_rank`` holds (chunks ``r`` and ``2 * cp - 1 - r``)."""
    if local_len % 2:
        raise ValueError(f"context parallelism needs an even local sequence length (2 chunks), got {local_len}")
    chunk = local_len // 2
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def _global_rank(group: Any, index: int) -> int:
    return dist.get_global_rank(group, index)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of a [group size, ...] tensor (slice i goes to rank i); its backward is the same."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: Tensor, group: Any) -> Tensor:
    x = x.contiguous()  # the collective reads and writes memory in row-major order: both tensors must be laid out so
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


class _RingShift(torch.autograd.Function):
    """Send ``x`` to the next rank of the group and receive the previous rank's; the backward sends the gradient
    the other way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _shift(x.contiguous(), group, +1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _shift(grad.contiguous(), ctx.group, -1), None


def _shift(x: Tensor, group: Any, step: int) -> Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(x, memory_format=torch.contiguous_format)
    ops = [dist.P2POp(dist.isend, x, _global_rank(group, (rank + step) % size), group, _TAG),
           dist.P2POp(dist.irecv, received, _global_rank(group, (rank - step) % size), group, _TAG)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _gather_rows(x: Tensor, group: Any) -> Tensor:
    """Every rank's ``x`` concatenated along dim 0, in group order (no gradient: positions and masks)."""
    x = x.contiguous()
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def _to_heads(x: Tensor, group: Any) -> Tensor:
    """[s, b, h, d] split over the group by sequence -> [size * s, b, h / size, d] (group order), split by head."""
    size = dist.get_world_size(group)
    s, b, h, d = x.shape
    sliced = x.reshape(s, b, size, h // size, d).permute(2, 0, 1, 3, 4)  # slice i: the heads rank i takes
    return _AllToAll.apply(sliced.contiguous(), group).reshape(size * s, b, h // size, d)


def _to_sequence(x: Tensor, group: Any) -> Tensor:
    """The inverse of :func:`_to_heads`: [size * s, b, h / size, d] -> [s, b, h, d]."""
    size = dist.get_world_size(group)
    total, b, h, d = x.shape
    back = _AllToAll.apply(x.reshape(size, total // size, b, h, d).contiguous(), group)  # slice j: head group j
    return back.permute(1, 2, 0, 3, 4).reshape(total // size, b, size * h, d)


def _heads_divide(query: Tensor, key: Tensor, value: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Key/value with a head count the all-to-all can split ``size`` ways (GQA groups repeated if needed)."""
    heads, groups = query.shape[2], key.shape[2]
    if heads % size:
        raise ValueError(f"Ulysses context parallelism (cp_comm_type a2a) splits the attention heads over the "
                         f"{size} ranks of its group, but this rank has {heads} query heads (after tensor "
                         f"parallelism): use cp_comm_type p2p (ring attention), or a head count divisible by {size}")
    if groups % size:
        key, value = key.repeat_interleave(heads // groups, dim=2), value.repeat_interleave(heads // groups, dim=2)
    return key, value


class ContextParallelAttention:
    """One attention call of a CP layer: ``local`` is the plugin's attention on whole local tensors, ``lse`` the
    plugin's ``attention_lse``; ``groups`` the CP group (a2a, p2p) or [a2a group, ring group] (a2a+p2p)."""

    def __init__(self, comm_type: str, cp_group: Any, hierarchical: list[Any] | None, cp_rank: int, cp_size: int,
                 local: LocalAttention, lse: LseAttention | None, scale: float, dropout_p: float) -> None:
        if comm_type not in COMM_TYPES:
            raise ValueError(f"cp_comm_type {comm_type!r} is not one of {', '.join(COMM_TYPES)}")
        if comm_type in HYBRID and not hierarchical:
            raise ValueError("cp_comm_type a2a+p2p needs hierarchical_context_parallel_sizes "
                             "(--hierarchical-context-parallel-sizes A2A_SIZE RING_SIZE)")
        if comm_type not in ULYSSES and lse is None:
            raise ValueError("ring attention needs the plugin's attention_lse, which it does not provide: use "
                             "cp_comm_type a2a")
        self.comm_type, self.cp_group, self.hierarchical = comm_type, cp_group, hierarchical
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.local, self.lse, self.scale, self.dropout_p = local, lse, scale, dropout_p

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, keep: Tensor | None, causal: bool) -> Tensor:
        """[s/cp, b, n, d] query, [s/cp, b, ng, d] key/value, ``keep`` [b or 1, 1, s/cp or s, s] (True = attends;
        rows this rank's queries or all, columns the whole sequence) -> context [s/cp, b, n, d]."""
        positions = load_balanced_positions(query.shape[0], self.cp_size, self.cp_rank, query.device)
        if keep is not None:
            keep = self._rows(keep, positions, query.shape[0])
        if self.comm_type in ULYSSES:
            return self._ulysses(query, key, value, keep, causal, positions, self.cp_group, ring=None)
        if self.comm_type in HYBRID:
            assert self.hierarchical is not None  # checked in __init__
            return self._ulysses(query, key, value, keep, causal, positions, self.hierarchical[0],
                                 ring=self.hierarchical[1])
        return self._ring(query, key, value, keep, causal, positions, self.cp_group)

    def _rows(self, keep: Tensor, positions: Tensor, local_len: int) -> Tensor:
        """The mask's rows for this rank's queries (Megatron's get_batch_on_this_cp_rank slices them; a script may
        pass the whole mask)."""
        full = local_len * self.cp_size
        if keep.dim() != 4 or keep.shape[-1] != full:
            raise ValueError(f"with context parallelism the attention mask must be [b, 1, rows, {full}] (all "
                             f"{full} key positions), got {tuple(keep.shape)}")
        if keep.shape[-2] == full and full != local_len:
            return keep.index_select(-2, positions)
        if keep.shape[-2] != local_len:
            raise ValueError(f"the attention mask has {keep.shape[-2]} query rows; expected {local_len} (this "
                             f"rank's) or {full}")
        return keep

    def _ulysses(self, query: Tensor, key: Tensor, value: Tensor, keep: Tensor | None, causal: bool,
                 positions: Tensor, group: Any, ring: Any) -> Tensor:
        size = dist.get_world_size(group)
        key, value = _heads_divide(query, key, value, size)
        q, k, v = (_to_heads(t, group) for t in (query, key, value))
        held = _gather_rows(positions, group)
        order = torch.argsort(held)  # the gathered chunks in sequence order
        q, k, v = (t.index_select(0, order) for t in (q, k, v))
        held = held.index_select(0, order)
        if keep is not None:  # rows follow the queries: gathered over the group, then sorted
            rows = _gather_rows(keep.to(torch.uint8).transpose(0, 2), group).transpose(0, 2).bool()
            keep = rows.index_select(2, order)
        # whole sequences without a ring: the plugin's attention, causal as Megatron built it
        context = self.local(q, k, v, keep, causal) if ring is None else self._ring(q, k, v, keep, causal, held, ring)
        return _to_sequence(context.index_select(0, torch.argsort(order)), group)

    def _ring(self, query: Tensor, key: Tensor, value: Tensor, keep: Tensor | None, causal: bool,
              positions: Tensor, group: Any) -> Tensor:
        """Ring attention over ``group``: queries at ``positions`` against every rank's key/value block."""
        assert self.lse is not None  # checked in __init__
        size = dist.get_world_size(group)
        q = query.permute(1, 2, 0, 3)  # [b, n, s, d]
        k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, ng, s, d] (v's head size may differ)
        held = _gather_rows(positions.unsqueeze(0), group)  # [size, s]: every rank's key positions
        rank = dist.get_rank(group)
        out = lse = None
        for step in range(size):
            source = (rank - step) % size
            if step:
                k, v = _RingShift.apply(k, group), _RingShift.apply(v, group)
            key_positions = held[source]
            allowed = None
            if causal:
                allowed = (key_positions.unsqueeze(0) <= positions.unsqueeze(1))[None, None]
            if keep is not None:
                columns = keep.index_select(-1, key_positions)
                allowed = columns if allowed is None else allowed & columns
            if allowed is not None and not bool(allowed.any()):
                continue  # no query here may see this block (a causal block from later positions)
            block_out, block_lse = self.lse(q, k, v, attn_mask=allowed, causal=False, scale=self.scale,
                                            dropout_p=self.dropout_p)
            out, lse = merge_partial(out, lse, block_out, block_lse)
        assert out is not None  # a query always sees its own position's block unless masked by the user
        return out.to(query.dtype).permute(2, 0, 1, 3)


def merge_partial(out: Tensor | None, lse: Tensor | None, block_out: Tensor,
                  block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets: ``out``/``block_out`` [B, N, S, D]
    (accumulated in ``block_lse``'s dtype, fp32 or wider), ``lse``/``block_lse`` [B, N, S]. Rows that attend to no key
    in either stay zeros / -inf, with finite gradients."""
    if out is None or lse is None:
        return block_out.to(block_lse.dtype), block_lse
    peak = torch.maximum(lse, block_lse).detach()  # any shift gives the same result: this one keeps exp() finite
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w_old, w_new = torch.exp(lse - peak), torch.exp(block_lse - peak)
    total = w_old + w_new
    some = total > 0
    safe = torch.where(some, total, torch.ones_like(total))
    merged = (out * w_old.unsqueeze(-1) + block_out.to(out.dtype) * w_new.unsqueeze(-1)) / safe.unsqueeze(-1)
    return merged, torch.where(some, peak + torch.log(safe), torch.full_like(total, float("-inf")))
