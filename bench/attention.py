"""Causal attention: devshim's kernel in every vendor layout against raw SDPA and against Megatron's unfused path.

Issue 30, "do no harm, measured": wherever devshim's attention serves DeepSpeed or Megatron it is never slower
than the path without it and never holds more memory at its peak. Targets: devshim's time <= 1.00x SDPA's and its
peak memory <= 1.00x SDPA's, at s = 512-4096, fp32 and bf16, MHA and GQA; moonshot: <= 0.85x SDPA's time at every
size, at equal or lower memory.

Protocol. Peers, on the same data, in paired rounds with alternating order (:func:`bench.stats.interleaved_rounds`):
forward+backward (``torch.autograd.grad`` of the output with one fixed upstream gradient: what training runs)
and, on the base grid, the forward alone under ``no_grad``. Every row is a kernel timed in isolation. 8 rounds of
one call after one warm-up call (2 rounds of 5 calls in quick mode).

Peers:

- raw ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on BNSD tensors; target: devshim in each
  layout no slower (time ratio <= 1.00; it was 1.15). ``TND`` packs the batch's equal-length sequences. For
  GQA the peer is SDPA's own grouped attention, ``enable_gqa=True`` (torch >= 2.5; the installed 2.13 has it):
  what a user runs at its best. Measured at s=1024 on 2 cores, it runs the same CPU flash kernels as
  ``repeat_interleave`` of k and v to the query heads followed by MHA, in the same time in fp32 (33.4 ms both)
  and a little less in bf16 (23.7 against 24.9 ms), without the copies of k and v.
  A row whose devshim side runs SDPA's own kernels (``bench.kernel_calls.kernels_of``: devshim's BNSD, and
  every layout whose view and copy cost stays under its 5% share) times SDPA against itself and is
  informational; its moonshot too.
- megatron-core's own ``DotProductAttention`` (the local, unfused implementation: ``baddbmm`` with
  alpha = 1/sqrt(d) into the global memory buffer, ``FusedScaleMaskSoftmax``'s torch path with the mask filled
  with -10000, dropout, ``bmm``) with the boolean causal mask Megatron's GPT passes; its [s, b, heads, d]
  inputs are views of the very tensors devshim's ``SBH`` contender gets, so that contender's rounds are
  devshim's side of this comparison too. Target: devshim >= 2x faster (ratio <= 0.5).
  Megatron runs unpatched on one gloo process; two CPU gaps are bridged from outside, neither touching the
  timed math: its global memory buffer is pre-sized (it would allocate on ``torch.cuda.current_device()``), and
  the RNG tracker is Megatron's inference tracker, whose ``fork()`` is a no-op (the training tracker swaps CUDA
  RNG states; with attention dropout 0 the fork only does bookkeeping). Megatron runs in fp32 MHA only.

Before timing, devshim (SBH) and Megatron are checked to compute the same attention: outputs, and the
gradients w.r.t. q, k and v for the same upstream gradient (``assert_close`` at ``MATCH_TOLERANCE`` of the dtype:
fp32, atol = rtol = 1e-4; a dtype without a tolerance there is refused, not compared).

Grid (:func:`grid`), batch 1, hidden 512 (8 query heads of 64 or 4 of 128), default thread count:

- base: fp32 MHA, s in (512, 1024, 2048), d in (64, 128): all five layouts (BNSD, BSND, BSH, SBH, TND) and
  Megatron, forward+backward and forward alone;
- extended, forward+backward only, layouts BNSD (SDPA's own), SBH (Megatron's, which MindSpeed passes on) and
  TND (packed): fp32 MHA at s=4096 for d=64 (with Megatron) and d=128; and d=64 at s in (512, 1024, 2048, 4096)
  for fp32 GQA, bf16 MHA and bf16 GQA (GQA: 8 query heads sharing 2 key/value heads). A GQA case is named
  "... 1x8h 2kv ...".

Memory, two figures per contender:

- the bytes autograd holds for the backward after one forward with grad enabled: the unique storages of the
  tensors saved for backward (``saved_tensors_hooks``), each storage's ``nbytes()`` once, without the storages of
  the inputs (q, k, v and Megatron's causal mask: they exist anyway) nor Megatron's persistent global memory
  buffer (allocated once per process, not per forward; its beta = 0 ``baddbmm`` saves no view of it today).
  devshim's attention runs SDPA's own kernel, which keeps its output and a logsumexp (O(S)); Megatron keeps the
  full S x S probabilities. Checked once by hand at s=1024 and 2048: the figure equals the net allocation
  ``torch.profiler`` records over the forward, less the output where it is not saved (devshim BNSD, SDPA,
  Megatron).
- the peak: the most bytes the host allocator held above its starting level during one call (``torch.profiler``'s
  allocation and free events, summed in order; see :func:`peak_bytes`), of one forward+backward (the outputs,
  the input gradients and both passes' temporaries: what a training step pays at once) and, for the rows of the
  forward alone, of one forward under ``no_grad``.

Memory rule, judged per row (:func:`memory_judgement`): ``details["peak_memory_ratio"]`` = devshim's peak / the
peer's, in the row's own mode (``details["peak_memory_of"]``), and ``details["memory_verdict"]`` "met" when it is
<= 1.00 (``memory_max_ratio``), else "missed". A peak is one deterministic figure per contender, with no rounds
and so no interval: met or missed, never inconclusive. Megatron's rows carry it too. Each case adds a Note: the
largest devshim / SDPA peak ratio of its rows, and which rows missed. Every row's details also hold
``subject_peak_bytes``/``peer_peak_bytes`` (forward+backward, on the rows of the forward alone too),
``subject_forward_peak_bytes``/``peer_forward_peak_bytes`` (rows of the forward alone), the saved bytes, and
``dtype``, ``heads``, ``kv_heads``, ``seq``, ``head_dim``. The SDPA rows add the moonshot:
``details["moonshot_max_ratio"]`` = 0.85 and ``details["moonshot"]``, :func:`bench.stats.verdict` of the row's
time ratio against 0.85 ("informational" on an informational row).

Time: the base grid about 2 minutes on 2 quiet cores; the extended grid measured at s=4096 with 2 rounds on the
same 2 cores while shared (load 9-14, SDPA fp32 2-4x its quiet time): fp32 MHA d=64 with Megatron 66 s, fp32
GQA 27 s, bf16 MHA 32 s, bf16 GQA 21 s, which with 8 rounds extrapolates to about 128, 52, 53 and 36 s, and
about 50 s for fp32 MHA d=128; the shorter lengths add about a third of the s=4096 figures. About 10 minutes
in all on those shared cores, about 5 on quiet ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import devshim_kernels as K
import torch
import torch.distributed as dist
import torch.nn.functional as F
from devshim_kernels.layouts import DENSE_LAYOUTS, from_bnsd

from bench.common import Comparison, Note, Result
from bench.kernel_calls import forward_backward, forward_only, kernels_of, outputs_and_gradients
from bench.stats import interleaved_rounds, verdict

Tensor = torch.Tensor
GROUP = "attention"
# issue 30: where devshim's attention serves a framework it must never be slower than SDPA (it was ≤ 1.15×), nor
# hold more memory at its peak; the moonshot is ≤ 0.85× SDPA's time at equal or lower memory
SDPA_MAX_RATIO, MOONSHOT_MAX_RATIO, MEMORY_MAX_RATIO = 1.0, 0.85, 1.0
SDPA_TARGET, MEGATRON_TARGET = "≤ 1.00× raw SDPA's time", "≥ 2× faster than Megatron's unfused attention"
SDPA, MEGATRON = "sdpa", "megatron"
ROUNDS, QUICK_ROUNDS = 8, 2
QUICK_CALLS = 5  # toy sizes run in well under a millisecond: average a few calls per figure
# devshim against Megatron, per dtype: the two sum the same products in different orders. Megatron runs in fp32
# only (grid()); a dtype missing here is refused rather than compared at a guessed tolerance
MATCH_TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}}
MIB = 1 << 20
BATCH, HIDDEN = 1, 512  # hidden = query heads x head size: 8 heads of 64 or 4 of 128
GQA_KV_HEADS = 2  # GQA: 8 query heads of 64 share 2 key/value heads (4 query heads per group)
ALL_LAYOUTS = (*DENSE_LAYOUTS, "TND")
# the extended grid's layouts: BNSD (SDPA's own), SBH (Megatron's, which MindSpeed passes on) and packed TND
EXTENDED_LAYOUTS = ("BNSD", "SBH", "TND")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Case:
    """One attention shape and which contenders and modes it runs."""

    seq: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    kv_heads: int | None = None  # None: as many as the query heads (MHA)
    layouts: tuple[str, ...] = ALL_LAYOUTS
    megatron: bool = True  # against Megatron's DotProductAttention too (fp32 MHA only; needs the SBH layout)
    forward: bool = True  # the forward alone under no_grad too, not only forward+backward

    @property
    def heads(self) -> int:
        return HIDDEN // self.head_dim

    @property
    def groups(self) -> int:
        return self.kv_heads or self.heads

    @property
    def gqa(self) -> bool:
        return self.groups != self.heads

    @property
    def shape(self) -> str:
        """The rows' case, less the mode: "causal fp32 s=512 d=64 1x8h", GQA adding e.g. " 2kv"."""
        kv = f" {self.groups}kv" if self.gqa else ""
        return f"causal {DTYPE_NAMES[self.dtype]} s={self.seq} d={self.head_dim} {BATCH}x{self.heads}h{kv}"

    @property
    def label(self) -> str:
        """The notes' name for the case: "s=512 d=64" for fp32 MHA, else prefixed by dtype and/or GQA."""
        prefix = [DTYPE_NAMES[self.dtype]] if self.dtype != torch.float32 else []
        prefix += [f"GQA {self.heads}q/{self.groups}kv"] if self.gqa else []
        return " ".join([*prefix, f"s={self.seq} d={self.head_dim}"])


SEQS = (512, 1024, 2048, 4096)
# Megatron at the longest length too, forward+backward, for these head sizes (about 2.5 s a call at d=64 on 2 cores)
MEGATRON_LONGEST_HEAD_DIMS = (64,)


def grid(quick: bool = False) -> list[Case]:
    """The cases, in the order they run (see the module docstring)."""
    if quick:
        return [Case(64, 64), Case(64, 128),
                Case(64, 64, torch.bfloat16, GQA_KV_HEADS, EXTENDED_LAYOUTS, megatron=False, forward=False)]
    full = [Case(s, d) for s in SEQS[:-1] for d in (64, 128)]
    longest = [Case(SEQS[-1], d, layouts=EXTENDED_LAYOUTS, megatron=d in MEGATRON_LONGEST_HEAD_DIMS,
                    forward=False)
               for d in (64, 128)]
    extended = [Case(s, 64, dtype, kv, EXTENDED_LAYOUTS, megatron=False, forward=False)
                for dtype, kv in ((torch.float32, GQA_KV_HEADS), (torch.bfloat16, None),
                                  (torch.bfloat16, GQA_KV_HEADS)) for s in SEQS]
    return full + longest + extended



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


def memory_judgement(subject_peak: int, peer_peak: int) -> dict[str, Any]:
    """The peak-memory rule, as a row's details: devshim's peak over the peer's, met when ≤ 1.00. One figure
    per contender (the allocator's events are the same from call to call), so no interval: met or missed."""
    ratio = subject_peak / peer_peak if peer_peak else (1.0 if subject_peak == 0 else float("inf"))
    return {"peak_memory_ratio": ratio, "memory_max_ratio": MEMORY_MAX_RATIO,
            "memory_verdict": "met" if ratio <= MEMORY_MAX_RATIO else "missed"}


def _devshim(q: Tensor, k: Tensor, v: Tensor, layout: str, heads: int, cu: Tensor) -> Callable[[], Tensor]:
    return lambda: K.attention(q, k, v, layout=layout, num_heads=heads, causal=True, cu_seqlens_q=cu)


def check_megatron_match(ours: Callable[[], Tensor], megatron: Callable[[], Tensor], inputs: tuple[Tensor, ...],
                         grad: Tensor) -> None:
    """devshim and Megatron compute the same attention, forward and backward, or the ratio means nothing."""
    if grad.dtype not in MATCH_TOLERANCE:
        raise ValueError(f"no tolerance to compare devshim with Megatron in {grad.dtype}")
    for what, a, b in outputs_and_gradients(ours, megatron, inputs, grad):
        torch.testing.assert_close(a, b, **MATCH_TOLERANCE[grad.dtype],
                                   msg=lambda m, what=what: f"Megatron, {what}: {m}")


def _case(case: Case, rounds: int, warmup: int, calls: int, with_megatron: bool) -> list[Result]:
    heads, groups, seq, head_dim = case.heads, case.groups, case.seq, case.head_dim
    with_megatron = with_megatron and case.megatron
    if with_megatron and (case.gqa or case.dtype != torch.float32 or "SBH" not in case.layouts):
        raise ValueError(f"{case.shape}: Megatron's comparison needs fp32 MHA and devshim's SBH contender")
    q_base = torch.randn(BATCH, heads, seq, head_dim, dtype=case.dtype)
    k_base, v_base = (torch.randn(BATCH, groups, seq, head_dim, dtype=case.dtype) for _ in range(2))
    grad_bnsd = torch.randn(BATCH, heads, seq, head_dim, dtype=case.dtype)

    def leaves(layout: str) -> tuple[Tensor, ...]:
        if layout == "TND":
            return tuple(from_bnsd(t, "BSND").flatten(0, 1).requires_grad_() for t in (q_base, k_base, v_base))
        return tuple(from_bnsd(t, layout).contiguous().requires_grad_() for t in (q_base, k_base, v_base))

    cu = torch.arange(0, (BATCH + 1) * seq, seq, dtype=torch.int32)
    # name -> (forward, the leaves it differentiates, upstream gradient, storages that exist without it)
    contenders: dict[str, tuple[Callable[[], Tensor], tuple[Tensor, ...], Tensor, tuple[Tensor, ...]]] = {}
    q, k, v = leaves("BNSD")
    # GQA: SDPA's own grouped attention (enable_gqa), as a user runs it: no copy of k and v, and on this torch as
    # fast as repeat_interleave to the query heads followed by MHA (measured; the module docstring)
    gqa = {"enable_gqa": True} if case.gqa else {}
    contenders[SDPA] = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa), (q, k, v),
                        grad_bnsd, (q, k, v))
    for layout in case.layouts:
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

    modes = ("fwd+bwd", "fwd") if case.forward else ("fwd+bwd",)
    calls_of = {"fwd+bwd": lambda c: forward_backward(*c[:3]), "fwd": lambda c: forward_only(c[0])}
    saved = {name: saved_for_backward_bytes(c[0], c[3]) for name, c in contenders.items()}
    # peak memory per mode: the judged memory of a row is its own mode's (the forward alone: inference)
    peaks = {mode: {name: peak_bytes(calls_of[mode](c)) for name, c in contenders.items()} for mode in modes}
    times = {mode: interleaved_rounds({name: calls_of[mode](c) for name, c in contenders.items()}, rounds=rounds,
                                      warmup=warmup, calls=calls) for mode in modes}
    # which kernels do each contender's work: a row whose two sides run the same ones (devshim's BNSD calls SDPA
    # itself; under no_grad every layout does, its views costing too little to show) is informational
    kernels = {mode: kernels_of({name: calls_of[mode](c) for name, c in contenders.items()}) for mode in modes}
    about = {"dtype": DTYPE_NAMES[case.dtype], "heads": heads, "kv_heads": groups, "seq": seq, "head_dim": head_dim}

    def memory(subject: str, peer: str, mode: str) -> dict[str, Any]:
        # subject/peer_peak_bytes stay the forward+backward peaks on every row (docs/img/bench-attention.svg)
        found = {"subject_saved_bytes": saved[subject], "peer_saved_bytes": saved[peer],
                 "subject_peak_bytes": peaks["fwd+bwd"][subject], "peer_peak_bytes": peaks["fwd+bwd"][peer]}
        if mode == "fwd":
            found |= {"subject_forward_peak_bytes": peaks["fwd"][subject],
                      "peer_forward_peak_bytes": peaks["fwd"][peer]}
        return {**about, **found, "peak_memory_of": mode, **memory_judgement(peaks[mode][subject], peaks[mode][peer])}

    results: list[Result] = []
    memory_rows: list[tuple[str, dict[str, Any]]] = []
    for mode in modes:
        for layout in case.layouts:
            ours, theirs = kernels[mode][layout], kernels[mode][SDPA]
            row = Comparison(GROUP, f"{case.shape} {mode}", f"devshim attention ({layout})", times[mode][layout],
                             "raw SDPA (BNSD)", times[mode][SDPA], SDPA_MAX_RATIO, SDPA_TARGET,
                             memory(layout, SDPA, mode), kernel_only=True, judged=ours != theirs,
                             subject_kernels=ours, peer_kernels=theirs)
            row.details |= {"moonshot_max_ratio": MOONSHOT_MAX_RATIO,
                            "moonshot": verdict(row.estimate, MOONSHOT_MAX_RATIO) if row.judged else "informational"}
            results.append(row)
            memory_rows.append((f"{layout} {mode}", row.details))
        if with_megatron:
            results.append(Comparison(GROUP, f"{case.shape} {mode}", "devshim attention (SBH)", times[mode]["SBH"],
                                      "Megatron DotProductAttention", times[mode][MEGATRON], 0.5, MEGATRON_TARGET,
                                      memory("SBH", MEGATRON, mode), kernel_only=True,
                                      subject_kernels=kernels[mode]["SBH"], peer_kernels=kernels[mode][MEGATRON]))
    missed = [name for name, details in memory_rows if details["memory_verdict"] == "missed"]
    results.append(Note(GROUP, f"peak memory devshim / raw SDPA, {case.label}: the largest ratio of its "
                               f"{len(memory_rows)} rows (≤ {MEMORY_MAX_RATIO:.2f}× met by "
                               f"{len(memory_rows) - len(missed)}" + (f"; missed by {', '.join(missed)})" if missed
                                                                       else ")"),
                        round(max(d["peak_memory_ratio"] for _, d in memory_rows), 4), "×"))
    who = [("devshim (BNSD)", "BNSD"), ("raw SDPA (BNSD)", SDPA)]
    if with_megatron:
        who.append(("Megatron DotProductAttention", MEGATRON))
    results += [Note(GROUP, f"{case.label}: bytes held for backward, {name}", round(saved[key] / MIB, 2), "MiB")
                for name, key in who]
    results += [Note(GROUP, f"{case.label}: peak memory of one forward+backward, {name}",
                     round(peaks["fwd+bwd"][key] / MIB, 2), "MiB") for name, key in who]
    return results


def run(quick: bool = False) -> list[Result]:
    torch.manual_seed(0)
    cases = grid(quick)
    with_megatron = importlib.util.find_spec("megatron") is not None  # megatron-core is an optional extra
    results: list[Result] = []
    if not with_megatron:
        results.append(Note(GROUP, "Megatron comparison skipped: megatron-core is not installed", 0.0, ""))
    world = megatron_single_process if with_megatron else lambda *_: contextlib.nullcontext()
    with world(max(BATCH * c.heads * c.seq * c.seq for c in cases if c.megatron), torch.float32):
        # full size: every call takes >= ~8 ms, far above the timer's resolution, so one call per figure; and one
        # warm-up call pays the one-off costs (first allocations, lazy initialisation) of every contender
        rounds, warmup, calls = (QUICK_ROUNDS, 1, QUICK_CALLS) if quick else (ROUNDS, 1, 1)
        for case in cases:
            results += _case(case, rounds, warmup, calls, with_megatron)
    return results
