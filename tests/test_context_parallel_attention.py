"""Context-parallel attention (``integrations/megatron/context_parallel.py``) on real process groups.

Each rank holds Megatron's load-balanced share of every sequence (chunks ``r`` and ``2 * cp - 1 - r``); the
output and the gradients of its query, key and value must equal those of attention over the whole sequence on one
process, at the positions the rank holds. Ulysses (a2a), ring attention (p2p, all_gather) and both (a2a+p2p), on
2 and 4 gloo ranks, causal and not, with a padding mask, with grouped-query heads and with heads that do not split.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import devshim_kernels as dk
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from devshim_core.integrations.megatron import context_parallel as cp

S, B, D = 16, 2, 8
SCALE = 0.3


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                     causal: bool) -> torch.Tensor:
    """The plugin's attention as the Megatron patch calls it: [s, b, n, d] in and out."""
    out = dk.attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), attn_mask=keep,
                       causal=causal, scale=SCALE)
    return out.permute(2, 0, 1, 3)


def _inputs(heads: int, groups: int, masked: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    tensors = {"q": torch.randn(S, B, heads, D, generator=g, dtype=torch.float64),
               "k": torch.randn(S, B, groups, D, generator=g, dtype=torch.float64),
               "v": torch.randn(S, B, groups, D, generator=g, dtype=torch.float64),
               "w": torch.randn(S, B, heads, D, generator=g, dtype=torch.float64)}
    if masked:  # padding: the last keys of the second sequence are masked for every query
        keep = torch.ones(B, 1, S, S, dtype=torch.bool)
        keep[1, :, :, S - 5:] = False
        tensors["keep"] = keep
    return tensors


def _reference(t: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    q, k, v = (t[n].clone().requires_grad_() for n in "qkv")
    out = _local_attention(q, k, v, t.get("keep"), causal)
    (out * t["w"]).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _worker(rank: int, world: int, port: int, case: dict[str, Any], results: Any) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        t = _inputs(case["heads"], case["groups"], case["masked"])
        hierarchical = None
        if case["comm_type"] == "a2a+p2p":  # Megatron's levels: [0, 1] [2, 3] then [0, 2] [1, 3]
            inner = [dist.new_group(r) for r in ([0, 1], [2, 3])]
            outer = [dist.new_group(r) for r in ([0, 2], [1, 3])]
            hierarchical = [inner[rank // 2], outer[rank % 2]]
        group = dist.group.WORLD
        positions = cp.load_balanced_positions(S // world, world, rank, torch.device("cpu"))
        q, k, v = (t[n].index_select(0, positions).clone().requires_grad_() for n in "qkv")
        keep = t.get("keep")
        if keep is not None:
            keep = keep.index_select(2, positions)  # as get_batch_on_this_cp_rank slices the mask's rows
        attention = cp.ContextParallelAttention(case["comm_type"], group, hierarchical, rank, world,
                                                _local_attention, dk.attention_with_lse, SCALE, 0.0)
        out = attention(q, k, v, keep, case["causal"])
        (out * t["w"].index_select(0, positions)).sum().backward()
        want = _reference(t, case["causal"])
        problems = []
        for name, got in (("out", out.detach()), ("q", q.grad), ("k", k.grad), ("v", v.grad)):
            expected = want[name].index_select(0, positions)
            if not torch.allclose(got, expected, atol=1e-10, rtol=1e-9):
                problems.append(f"{name}: max error {(got - expected).abs().max().item():.3e}")
        results[rank] = problems
        dist.destroy_process_group()
    except Exception:  # reported by the parent
        results[rank] = [traceback.format_exc()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, **case: Any) -> None:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, _free_port(), case, results), nprocs=world, join=True)
    assert {rank: results[rank] for rank in range(world)} == {rank: [] for rank in range(world)}


@pytest.mark.parametrize("comm_type", ["a2a", "p2p", "all_gather"])
@pytest.mark.parametrize(("causal", "masked"), [(True, False), (False, False), (True, True)],
                         ids=["causal", "full", "causal+padding"])
def test_two_ranks_equal_attention_over_the_whole_sequence(comm_type: str, causal: bool, masked: bool) -> None:
    _run(2, comm_type=comm_type, causal=causal, masked=masked, heads=4, groups=4)


@pytest.mark.parametrize("comm_type", ["a2a", "p2p"])
def test_grouped_query_heads_fewer_than_the_ranks_are_repeated_for_ulysses(comm_type: str) -> None:
    _run(2, comm_type=comm_type, causal=True, masked=False, heads=4, groups=1)


@pytest.mark.parametrize("comm_type", ["a2a", "p2p", "a2a+p2p"])
def test_four_ranks_including_ulysses_within_pairs_and_a_ring_across_them(comm_type: str) -> None:
    _run(4, comm_type=comm_type, causal=True, masked=True, heads=4, groups=2)


def test_ulysses_refuses_heads_that_do_not_split_over_the_ranks_naming_the_ring() -> None:
    with pytest.raises(ValueError, match=r"has 3 query heads.*use cp_comm_type p2p"):
        cp._heads_divide(torch.zeros(4, 1, 3, 2), torch.zeros(4, 1, 3, 2), torch.zeros(4, 1, 3, 2), 2)


def test_an_unknown_comm_type_and_a_hybrid_without_levels_are_refused() -> None:
    with pytest.raises(ValueError, match="'ring' is not one of p2p, all_gather, allgather, a2a, a2a\\+p2p"):
        cp.ContextParallelAttention("ring", None, None, 0, 2, _local_attention, dk.attention_with_lse, 1.0, 0.0)
    with pytest.raises(ValueError, match="needs hierarchical_context_parallel_sizes"):
        cp.ContextParallelAttention("a2a+p2p", None, None, 0, 2, _local_attention, dk.attention_with_lse, 1.0, 0.0)


def test_positions_are_megatrons_load_balanced_chunks() -> None:
    assert cp.load_balanced_positions(4, 2, 0, torch.device("cpu")).tolist() == [0, 1, 6, 7]
    assert cp.load_balanced_positions(4, 2, 1, torch.device("cpu")).tolist() == [2, 3, 4, 5]
