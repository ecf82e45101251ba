"""Causal attention: devshim's kernel in every vendor layout against raw SDPA and against Megatron's unfused path.

Peers, on the same data, in paired rounds with alternating order (:func:`bench.stats.interleaved_rounds`):
forward+backward (``torch.autograd.grad`` of the output with one fixed upstream gradient: what training runs)
and, separately, the forward alone under ``no_grad``. Every row is a kernel timed in isolation.

- raw ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on BNSD tensors; target: devshim in each
  layout no slower (time ratio <= 1.00; issue 30, it was 1.15). ``TND`` packs the batch's equal-length sequences.
  A row whose devshim side runs SDPA's own kernels (``bench.kernel_calls.kernels_run``) is informational.
- megatron-core's own ``DotProductAttention`` (the local, unfused implementation: ``baddbmm`` with
  alpha = 1/sqrt(d) into the global memory buffer, ``FusedScaleMaskSoftmax``'s torch path with the mask filled
  with -10000, dropout, ``bmm``) with the boolean causal mask Megatron's GPT passes; its [s, b, heads, d]
  inputs are views of the very tensors devshim's ``SBH`` contender gets, so that contender's rounds are
  devshim's side of this comparison too. Target: devshim >= 2x faster (ratio <= 0.5).
  Megatron runs unpatched on one gloo process; two CPU gaps are bridged from outside, neither touching the
  timed math: its global memory buffer is pre-sized (it would allocate on ``torch.cuda.current_device()``), and
  the RNG tracker is Megatron's inference tracker, whose ``fork()`` is a no-op (the training tracker swaps CUDA
  RNG states; with attention dropout 0 the fork only does bookkeeping).

Before timing, devshim (SBH) and Megatron are checked to compute the same attention: outputs, and the
gradients w.r.t. q, k and v for the same upstream gradient (``assert_close``, fp32, atol = rtol = 1e-4).

Memory next to time: for every contender, the bytes autograd holds for the backward after one forward with
grad enabled: the unique storages of the tensors saved for backward (``saved_tensors_hooks``), each storage's
``nbytes()`` once, without the storages of the inputs (q, k, v and Megatron's causal mask: they exist anyway)
nor Megatron's persistent global memory buffer (allocated once per process, not per forward; its beta = 0
``baddbmm`` saves no view of it today). They go in each row's ``details`` and, per case, in Notes (MiB).
devshim's attention runs SDPA's own kernel (issue 30: it must hold no more than SDPA, and its blocked kernel,
which kept the causal blocks of the probabilities, was removed), which keeps its output and a logsumexp (O(S));
Megatron keeps the full S x S probabilities. Checked once by hand at s=1024 and 2048: the
figure equals the net allocation ``torch.profiler`` records over the forward, less the output where it is not
saved (devshim BNSD, SDPA, Megatron).

Peak memory next to time, too: for every contender, the most bytes the host allocator held above its starting
level during one forward+backward (``torch.profiler``'s allocation and free events, summed in order; see
:func:`peak_bytes`). That includes the outputs, the input gradients and both passes' temporaries, so it is
what a training step pays at once, where the saved bytes are only what waits for the backward.

fp32, batch 1, hidden 512 (8 heads of 64 or 4 of 128), default thread count; 8 rounds of one call after one
warm-up call (2 rounds of 5 calls in quick mode); about 2 minutes on 2 cores.
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

from bench.common import Comparison, Note, Result
from bench.kernel_calls import forward_backward, forward_only, kernels_run, outputs_and_gradients
from bench.stats import interleaved_rounds

Tensor = torch.Tensor
GROUP = "attention"
# issue 30: where devshim's attention serves a framework it must never be slower than SDPA (it was ≤ 1.15×)
SDPA_MAX_RATIO = 1.0
SDPA_TARGET, MEGATRON_TARGET = "≤ 1.00× raw SDPA's time", "≥ 2× faster than Megatron's unfused attention"
SDPA, MEGATRON = "sdpa", "megatron"
ROUNDS, QUICK_ROUNDS = 8, 2
QUICK_CALLS = 5  # toy sizes run in well under a millisecond: average a few calls per figure
MATCH_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # fp32; the two sum the same products in different orders
MIB = 1 << 20


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


def megatron_global_buffers() -> list[Tensor]:
    """Megatron's persistent scores buffers: a saved view of one would otherwise count the whole buffer."""
    from megatron.core import parallel_state
    return list(parallel_state.get_global_memory_buffer().buffer.values())


def megatron_attention(heads: int, head_dim: int) -> Callable[..., Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig
        config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                                   attention_dropout=0.0, use_cpu_initialization=True)
    return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def saved_for_backward_bytes(fn: Callable[[], Tensor], exclude: tuple[Tensor, ...]) -> int:
    """Bytes autograd holds for the backward after one forward of ``fn``: the unique storages of the saved
    tensors, without the storages of ``exclude`` (tensors that exist whether or not anything is saved)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t  # keeping t keeps its storage alive, so no pointer is reused while we count

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    del out
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in skip)


def peak_bytes(call: Callable[[], object]) -> int:
    """The most bytes the host allocator held, above its level when ``call`` started, during one ``call``: the
    running sum of every allocation and free ``torch.profiler`` records (``profile_memory=True``), in order.
    For one forward+backward that is the outputs, the gradients, what is saved for the backward and the
    temporaries of both passes; what ``call`` returns is freed before the profiler stops."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events: list[tuple[int, int]] = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))  # negative for a free
        pending.extend(node.children)
    held = peak = 0
    for _, size in sorted(events):
        held += size
        peak = max(peak, held)
    return peak


def _devshim(q: Tensor, k: Tensor, v: Tensor, layout: str, heads: int, cu: Tensor) -> Callable[[], Tensor]:
    return lambda: K.attention(q, k, v, layout=layout, num_heads=heads, causal=True, cu_seqlens_q=cu)


def check_megatron_match(ours: Callable[[], Tensor], megatron: Callable[[], Tensor], inputs: tuple[Tensor, ...],
                         grad: Tensor) -> None:
    """devshim and Megatron compute the same attention, forward and backward, or the ratio means nothing."""
    for what, a, b in outputs_and_gradients(ours, megatron, inputs, grad):
        torch.testing.assert_close(a, b, **MATCH_TOLERANCE, msg=lambda m, what=what: f"Megatron, {what}: {m}")


def _case(seq: int, head_dim: int, batch: int, hidden: int, rounds: int, warmup: int, calls: int,
          with_megatron: bool) -> list[Result]:
    heads = hidden // head_dim
    base = [torch.randn(batch, heads, seq, head_dim) for _ in range(3)]
    grad_bnsd = torch.randn(batch, heads, seq, head_dim)

    def leaves(layout: str) -> tuple[Tensor, ...]:
        if layout == "TND":
            return tuple(from_bnsd(t, "BSND").flatten(0, 1).requires_grad_() for t in base)
        return tuple(from_bnsd(t, layout).contiguous().requires_grad_() for t in base)

    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    # name -> (forward, the leaves it differentiates, upstream gradient, storages that exist without it)
    contenders: dict[str, tuple[Callable[[], Tensor], tuple[Tensor, ...], Tensor, tuple[Tensor, ...]]] = {}
    q, k, v = leaves("BNSD")
    contenders[SDPA] = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad_bnsd,
                        (q, k, v))
    for layout in (*DENSE_LAYOUTS, "TND"):
        ql, kl, vl = leaves(layout)
        grad = from_bnsd(grad_bnsd, "BSND").flatten(0, 1) if layout == "TND" else from_bnsd(grad_bnsd, layout)
        contenders[layout] = (_devshim(ql, kl, vl, layout, heads, cu), (ql, kl, vl), grad.contiguous(), (ql, kl, vl))
    if with_megatron:
        # Megatron's [s, b, heads, d] inputs are views of devshim's SBH leaves: one set of tensors, so the SBH
        # contender is devshim's side of this comparison too and no third copy of the data is timed
        ours, sbh, grad_sbh, _ = contenders["SBH"]
        qm, km, vm = (t.unflatten(-1, (heads, head_dim)) for t in sbh)
        megatron = megatron_attention(heads, head_dim)
        causal_mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)  # True = masked, as Megatron's GPT has it
        contenders[MEGATRON] = (lambda: megatron(qm, km, vm, causal_mask), sbh, grad_sbh,
                                (*sbh, causal_mask, *megatron_global_buffers()))
        check_megatron_match(ours, contenders[MEGATRON][0], sbh, grad_sbh)

    saved = {name: saved_for_backward_bytes(c[0], c[3]) for name, c in contenders.items()}
    peaks = {name: peak_bytes(forward_backward(*c[:3])) for name, c in contenders.items()}
    both = interleaved_rounds({name: forward_backward(*c[:3]) for name, c in contenders.items()}, rounds=rounds,
                              warmup=warmup, calls=calls)
    fwd = interleaved_rounds({name: forward_only(c[0]) for name, c in contenders.items()}, rounds=rounds,
                             warmup=warmup, calls=calls)
    # which kernels do each contender's work: a row whose two sides run the same ones (under no_grad devshim
    # calls SDPA itself) times SDPA against SDPA and is informational
    kernels = {"fwd+bwd": {name: kernels_run(forward_backward(*c[:3])) for name, c in contenders.items()},
               "fwd": {name: kernels_run(forward_only(c[0])) for name, c in contenders.items()}}
    shape = f"causal fp32 s={seq} d={head_dim} {batch}x{heads}h"
    results: list[Result] = []
    for mode, times in (("fwd+bwd", both), ("fwd", fwd)):
        for layout in (*DENSE_LAYOUTS, "TND"):
            details = {"subject_saved_bytes": saved[layout], "peer_saved_bytes": saved[SDPA],
                       "subject_peak_bytes": peaks[layout], "peer_peak_bytes": peaks[SDPA]}
            ours, theirs = kernels[mode][layout], kernels[mode][SDPA]
            results.append(Comparison(GROUP, f"{shape} {mode}", f"devshim attention ({layout})", times[layout],
                                      "raw SDPA (BNSD)", times[SDPA], SDPA_MAX_RATIO, SDPA_TARGET, details,
                                      kernel_only=True,
                                      judged=ours != theirs, subject_kernels=ours, peer_kernels=theirs))
        if with_megatron:
            details = {"subject_saved_bytes": saved["SBH"], "peer_saved_bytes": saved[MEGATRON],
                       "subject_peak_bytes": peaks["SBH"], "peer_peak_bytes": peaks[MEGATRON]}
            results.append(Comparison(GROUP, f"{shape} {mode}", "devshim attention (SBH)", times["SBH"],
                                      "Megatron DotProductAttention", times[MEGATRON], 0.5, MEGATRON_TARGET, details,
                                      kernel_only=True, subject_kernels=kernels[mode]["SBH"],
                                      peer_kernels=kernels[mode][MEGATRON]))
    who = [("devshim (BNSD)", "BNSD"), ("raw SDPA (BNSD)", SDPA)]
    if with_megatron:
        who.append(("Megatron DotProductAttention", MEGATRON))
    results += [Note(GROUP, f"s={seq} d={head_dim}: bytes held for backward, {name}", round(saved[key] / MIB, 2),
                     "MiB") for name, key in who]
    results += [Note(GROUP, f"s={seq} d={head_dim}: peak memory of one forward+backward, {name}",
                     round(peaks[key] / MIB, 2), "MiB") for name, key in who]
    return results


def run(quick: bool = False) -> list[Result]:
    torch.manual_seed(0)
    batch, hidden = 1, 512
    grid = [(64, 64), (64, 128)] if quick else [(s, d) for s in (512, 1024, 2048) for d in (64, 128)]
    with_megatron = importlib.util.find_spec("megatron") is not None  # megatron-core is an optional extra
    results: list[Result] = []
    if not with_megatron:
        results.append(Note(GROUP, "Megatron comparison skipped: megatron-core is not installed", 0.0, ""))
    world = megatron_single_process if with_megatron else lambda *_: contextlib.nullcontext()
    with world(max(batch * (hidden // d) * s * s for s, d in grid), torch.float32):
        # full size: every call takes >= ~8 ms, far above the timer's resolution, so one call per figure; and one
        # warm-up call pays the one-off costs (first allocations, lazy initialisation) of every contender
        rounds, warmup, calls = (QUICK_ROUNDS, 1, QUICK_CALLS) if quick else (ROUNDS, 1, 1)
        for seq, head_dim in grid:
            results += _case(seq, head_dim, batch, hidden, rounds, warmup, calls, with_megatron)
    return results
