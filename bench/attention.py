"""Causal attention: devshim's kernel in every vendor layout against raw SDPA and against Megatron's unfused path.

Peers, on the same data, timed interleaved (forward+backward: what training runs; forward alone too):

- raw ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on BNSD tensors; target: devshim in each
  layout within 15% of it (time ratio <= 1.15). ``TND`` packs the batch's equal-length sequences.
- megatron-core's own ``DotProductAttention`` (the local, unfused implementation: ``baddbmm`` with
  alpha = 1/sqrt(d) into the global memory buffer, ``FusedScaleMaskSoftmax``'s torch path with the mask filled
  with -10000, dropout, ``bmm``) on its [s, b, heads, d] inputs with the boolean causal mask Megatron's GPT
  passes; devshim gets the same tensors as ``SBH`` views. Target: devshim >= 2x faster (ratio <= 0.5).
  Megatron runs unpatched on one gloo process; two CPU gaps are bridged from outside, neither touching the
  timed math: its global memory buffer is pre-sized (it would allocate on ``torch.cuda.current_device()``), and
  the RNG tracker is Megatron's inference tracker, whose ``fork()`` is a no-op (the training tracker swaps CUDA
  RNG states; with attention dropout 0 the fork only does bookkeeping).

Before timing, devshim's and Megatron's outputs are checked equal. Without megatron-core (an optional extra)
only the SDPA comparisons run. fp32, batch 1, hidden 512 (8 heads of 64 or 4 of 128), default thread count;
about 70 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Callable, Iterator

import devshim_kernels as K
import torch
import torch.distributed as dist
import torch.nn.functional as F
from devshim_kernels.layouts import DENSE_LAYOUTS, from_bnsd

from bench.common import Comparison, Note, Result, time_min_interleaved

Tensor = torch.Tensor
SDPA_TARGET, MEGATRON_TARGET = "≤ 1.15× raw SDPA's time", "≥ 2× faster than Megatron's unfused attention"


@contextlib.contextmanager
def megatron_single_process(max_scores: int, dtype: torch.dtype) -> Iterator[None]:
    """A one-rank gloo world with Megatron's model-parallel state, as its DotProductAttention needs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" and friends
        from megatron.core import parallel_state, tensor_parallel
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        # pre-sized so that get_tensor() never allocates (it would on torch.cuda.current_device())
        parallel_state.get_global_memory_buffer().buffer[("mpu", dtype)] = torch.empty(max_scores, dtype=dtype)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        tensor_parallel.random.initialize_rng_tracker(force_reset=True)
        if created:
            dist.destroy_process_group()


def megatron_attention(heads: int, head_dim: int) -> Callable[..., Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig
        config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                                   attention_dropout=0.0, use_cpu_initialization=True)
    return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _devshim(q: Tensor, k: Tensor, v: Tensor, layout: str, heads: int, cu: Tensor) -> Callable[[], Tensor]:
    return lambda: K.attention(q, k, v, layout=layout, num_heads=heads, causal=True, cu_seqlens_q=cu)


def _grad_fn(fn: Callable[[], Tensor], inputs: tuple[Tensor, ...], grad: Tensor) -> Callable[[], object]:
    return lambda: torch.autograd.grad(fn(), inputs, grad)


def _case(seq: int, head_dim: int, batch: int, hidden: int, repeats: int, warmup: int,
          with_megatron: bool) -> list[Result]:
    heads = hidden // head_dim
    base = [torch.randn(batch, heads, seq, head_dim) for _ in range(3)]
    grad_bnsd = torch.randn(batch, heads, seq, head_dim)

    def leaves(layout: str) -> tuple[Tensor, ...]:
        if layout == "TND":
            return tuple(from_bnsd(t, "BSND").flatten(0, 1).requires_grad_() for t in base)
        return tuple(from_bnsd(t, layout).contiguous().requires_grad_() for t in base)

    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    contenders: dict[str, tuple[Callable[[], Tensor], tuple[Tensor, ...], Tensor]] = {}
    q, k, v = leaves("BNSD")
    contenders["sdpa"] = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad_bnsd)
    for layout in (*DENSE_LAYOUTS, "TND"):
        ql, kl, vl = leaves(layout)
        grad = from_bnsd(grad_bnsd, "BSND").flatten(0, 1) if layout == "TND" else from_bnsd(grad_bnsd, layout)
        contenders[layout] = (_devshim(ql, kl, vl, layout, heads, cu), (ql, kl, vl), grad.contiguous())
    if with_megatron:
        qm, km, vm = (t.detach().permute(2, 0, 1, 3).contiguous().requires_grad_() for t in base)  # [s, b, n, d]
        megatron = megatron_attention(heads, head_dim)
        causal_mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)  # True = masked, as Megatron's GPT has it
        ours = _devshim(qm.flatten(-2), km.flatten(-2), vm.flatten(-2), "SBH", heads, cu)
        contenders["megatron"] = (lambda: megatron(qm, km, vm, causal_mask), (qm, km, vm), from_bnsd(grad_bnsd, "SBH"))
        contenders["SBH on megatron's tensors"] = (ours, (qm, km, vm), from_bnsd(grad_bnsd, "SBH"))
        with torch.no_grad():  # the two peers must compute the same attention, or the ratio means nothing
            torch.testing.assert_close(ours(), megatron(qm, km, vm, causal_mask), atol=1e-4, rtol=1e-4)

    both = time_min_interleaved({name: _grad_fn(*c) for name, c in contenders.items()}, repeats=repeats,
                                warmup=warmup)
    with torch.no_grad():
        fwd = time_min_interleaved({name: c[0] for name, c in contenders.items()}, repeats=repeats, warmup=warmup)
    shape = f"causal fp32 s={seq} d={head_dim} {batch}x{heads}h"
    results: list[Result] = []
    for mode, times in (("fwd+bwd", both), ("fwd", fwd)):
        for layout in (*DENSE_LAYOUTS, "TND"):
            results.append(Comparison("attention", f"{shape} {mode}", f"devshim attention ({layout})",
                                      times[layout], "raw SDPA (BNSD)", times["sdpa"], 1.15, SDPA_TARGET))
        if with_megatron:
            results.append(Comparison("attention", f"{shape} {mode}", "devshim attention (SBH)",
                                      times["SBH on megatron's tensors"], "Megatron DotProductAttention",
                                      times["megatron"], 0.5, MEGATRON_TARGET))
    return results


def run(quick: bool = False) -> list[Result]:
    torch.manual_seed(0)
    batch, hidden = 1, 512
    grid = [(64, 64), (64, 128)] if quick else [(s, d) for s in (512, 1024, 2048) for d in (64, 128)]
    with_megatron = importlib.util.find_spec("megatron") is not None  # megatron-core is an optional extra
    results: list[Result] = []
    if not with_megatron:
        results.append(Note("attention", "Megatron comparison skipped: megatron-core is not installed", 0.0, ""))
    world = megatron_single_process if with_megatron else lambda *_: contextlib.nullcontext()
    with world(max(batch * (hidden // d) * s * s for s, d in grid), torch.float32):
        for seq, head_dim in grid:
            big = seq * seq * hidden >= 2048 * 2048 * 512
            repeats, warmup = (2, 1) if quick else ((4, 1) if big else (7, 2))
            results += _case(seq, head_dim, batch, hidden, repeats, warmup, with_megatron)
    return results
