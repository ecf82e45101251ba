"""rms_norm, swiglu and rotary (half, interleaved): devshim's kernels against what a model would otherwise run.

Peers, each its own row:

- every op: the plain expression written out in torch (Megatron's and Hugging Face's unfused fallbacks), with
  autograd for the backward;
- every op, outside quick mode: that same plain expression through ``torch.compile`` (inductor, CPU C++ backend,
  ``dynamic=False``, ``fullgraph=True``), compiled afresh for each case and dtype (``torch._dynamo.reset()``;
  rotary's expression is the case's closure over its cos and sin). Its graphs (forward+backward and
  forward-only) are compiled by an untimed call of each before any round, and dynamo is set to fail rather than
  recompile while timing, so no compile time lands in a round; the compile time is a Note, with inductor's FX
  graph cache hits and misses (the cache is left as found; the first case's time includes dynamo's and
  inductor's one-off start-up). If it cannot compile, a Note says why and no row is added. Its rows also carry
  a moonshot in ``details``: devshim at most ``MOONSHOT_MAX_RATIO`` (0.80×) of the compiled peer's time, with
  its verdict by :func:`bench.stats.verdict` on the row's interval; reported, never counted as a target;
- rms_norm also: ``torch.nn.functional.rms_norm`` (what ``torch.nn.RMSNorm`` and Megatron's non-TE path run).

What is timed: forward+backward (``torch.autograd.grad`` of the output with one fixed upstream gradient, so no
gradient accumulation pass) and, separately, the forward alone under ``no_grad``, on the same tensors, in
paired rounds with alternating order (:func:`bench.stats.interleaved_rounds`): 8 rounds after 2 warm-up calls
and one untimed probe round (2 rounds after 1 warm-up call and the probe in quick mode); each round's figure is
the mean of as many calls as the probe says fill ``MIN_ROUND_SECONDS`` for the fastest contender. Every row is
a kernel timed in isolation. Before timing, each peer is checked to compute devshim's output and gradients
(``assert_close``, tolerances per dtype in ``MATCH_TOLERANCE``, the absolute one scaled by the largest
magnitude). Target for every row: devshim no slower than the peer (time ratio <= 1.0). A row whose two sides
run the same operators, or whose peer runs what the plain peer runs, is informational (``kernels_run``).

Bandwidth: at the start of the run, the machine's copy bandwidth: ``dst.copy_(src)`` over two fp32 buffers of
``COPY_BUFFER_BYTES`` (256 MiB), counted as 2 x nbytes (read src, write dst), the median of ``COPY_REPEATS``
copies after an untimed one that faults ``dst``'s pages in (a Note, in GB/s; in quick mode the buffers are
4 MiB and sit in the caches). Each row's ``details`` give the op's minimum bytes (``bytes_moved``, the same for
both sides) and each side's achieved GB/s as a fraction of that copy bandwidth
(``subject_fraction_of_copy_bandwidth``, ``peer_fraction_of_copy_bandwidth``; devshim's is the same in every
peer row of a case, all contenders being timed in the same rounds). The bytes rule, each tensor counted once at
its own dtype's size, whatever a kernel actually re-reads, saves or spills:

- forward: read every tensor the op reads (its inputs, and rotary's cos and sin), write the output;
- backward: read the upstream gradient and the tensors the gradient depends on (rms_norm: x and the weight;
  swiglu: x; rotary, linear in x: cos and sin only, not x), write each input's gradient; rms_norm's saved
  per-row statistic is not counted (1/hidden of x);
- a fwd+bwd row moves the forward's bytes plus the backward's; a fwd row the forward's.

So with x of n elements of e bytes: rms_norm fwd 2ne (+ the weight once), fwd+bwd 5ne (+ the weight 3 times);
swiglu (x of 2n, output n) fwd 3ne, fwd+bwd 8ne; rotary (cos and sin of c elements each) fwd 2ne + 2ce, fwd+bwd
4ne + 4ce.

A floor, not what a kernel moves (and a write's line fetch, left out here as in the copy's 2 x nbytes): a fraction
near or above 1 says an op is as memory-bound as the copy, not that it beats the machine. The copy is measured
once per run, so a busy moment then shifts every fraction of the run alike.

Sizes: LLaMA-7B-like activations, 4096 tokens x hidden 4096 (swiglu: 2 x 4096 in; rotary: 32 heads of 128),
and 8192 tokens x hidden 2048 (rms_norm there without weight); rotary also at 512 tokens x 4 heads of 64 (one
tensor-parallel rank of ``bench/megatron_step.py``'s model, where ``rotary``'s small-tensor threshold matters);
fp32 and bf16. About 2 minutes on 2 cores with inductor's FX graph cache warm, about 40 s more cold (14
compiles of 2 to 4 s): measured case by case at 2 rounds after 1 warm-up call and extrapolated to this
protocol, on an otherwise idle machine; a shared one makes it several times that.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, NamedTuple

import devshim_kernels as K
import torch
import torch.nn.functional as F

from bench.common import Comparison, Note, Result
from bench.kernel_calls import forward_backward, forward_only, kernels_run, outputs_and_gradients
from bench.stats import interleaved_rounds, verdict

Tensor = torch.Tensor
GROUP = "fused_ops"
EPS = 1e-6
TARGET = "no slower than the peer (≥ 1.0× its speed)"
# the moonshot against the compiled peer: 1.25x its speed; reported in the row's details, never a target
MOONSHOT_MAX_RATIO = 0.80
DEVSHIM, PLAIN, F_RMS_NORM, COMPILED = ("devshim_kernels", "plain torch + autograd", "torch.nn.functional.rms_norm",
                                        "torch.compile(plain expression), inductor")
ROUNDS, QUICK_ROUNDS = 8, 2
WARMUP, QUICK_WARMUP = 2, 1
# a figure per round of at least this long: far above perf_counter's resolution and a few scheduler ticks; more
# would only buy the slowest peers extra calls (the full run must stay near 2 minutes on 2 cores)
MIN_ROUND_SECONDS, QUICK_MIN_ROUND_SECONDS = 0.02, 0.002
MAX_CALLS = 200
# devshim accumulates in fp32 and rounds once; the peers may round in between (bf16) or sum in another order
MATCH_TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
# far above any last-level cache, so the copy streams from and to memory as the full-size ops do
COPY_BUFFER_BYTES, QUICK_COPY_BUFFER_BYTES = 256 * 2**20, 4 * 2**20
COPY_REPEATS = 5


class Case(NamedTuple):
    """One op at one size and dtype: what it is called on, both implementations, and what its bytes rule counts."""

    inputs: tuple[Tensor, ...]  # the differentiated inputs, in call order
    ours: Callable[..., Tensor]
    plain: Callable[..., Tensor]
    reads: tuple[Tensor, ...]  # every tensor the forward must read: the inputs and any constant (rotary's cos, sin)
    backward_reads: tuple[Tensor, ...]  # what the backward needs besides the upstream gradient


Make = Callable[[torch.dtype], Case]


def plain_rms_norm(x: Tensor, w: Tensor | None = None) -> Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return normed if w is None else normed * w


def functional_rms_norm(x: Tensor, w: Tensor | None = None) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def plain_swiglu(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def plain_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    return x * cos + turned * sin


def _cases(quick: bool) -> list[tuple[str, Make]]:
    """(name, make(dtype) -> Case) for LLaMA-7B-like and smaller-hidden shapes."""
    (tokens, hidden), (long_tokens, narrow) = ((64, 256), (128, 128)) if quick else ((4096, 4096), (8192, 2048))
    heads, head_dim = hidden // 128 or 1, min(hidden, 128)

    def norm(rows: int, width: int, weighted: bool) -> Make:
        def make(dtype: torch.dtype) -> Case:
            x = torch.randn(rows, width, dtype=dtype)
            if not weighted:
                return Case((x,), lambda x: K.rms_norm(x, None, EPS), plain_rms_norm, (x,), (x,))
            w = torch.randn(width, dtype=dtype)
            return Case((x, w), lambda x, w: K.rms_norm(x, w, EPS), plain_rms_norm, (x, w), (x, w))
        return make

    def glu(rows: int, width: int) -> Make:
        def make(dtype: torch.dtype) -> Case:
            x = torch.randn(rows, 2 * width, dtype=dtype)
            return Case((x,), K.swiglu, plain_swiglu, (x,), (x,))
        return make

    def rope(interleaved: bool, rows: int = tokens, count: int = heads, width: int = head_dim) -> Make:
        def make(dtype: torch.dtype) -> Case:
            x = torch.randn(rows, 1, count, width, dtype=dtype)  # SBND, as Megatron applies it
            angles = torch.randn(rows, 1, 1, width // 2)
            angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            # the backward of x * cos + turn(x) * sin needs cos and sin, not x
            return Case((x,), lambda x: K.rotary(x, cos, sin, interleaved=interleaved),
                        lambda x: plain_rotary(x, cos, sin, interleaved), (x, cos, sin), (cos, sin))
        return make

    rope_size = f"{tokens}x1x{heads}x{head_dim}"
    shard = (32, 2, 32) if quick else (512, 4, 64)  # a TP-2 shard of bench/megatron_step.py's attention
    return [(f"rms_norm {tokens}x{hidden}", norm(tokens, hidden, True)),
            (f"rms_norm no-weight {long_tokens}x{narrow}", norm(long_tokens, narrow, False)),
            (f"swiglu {tokens}x2*{hidden}", glu(tokens, hidden)),
            (f"swiglu {long_tokens}x2*{narrow}", glu(long_tokens, narrow)),
            (f"rotary half {rope_size}", rope(False)), (f"rotary interleaved {rope_size}", rope(True)),
            ("rotary half {}x1x{}x{}".format(*shard), rope(False, *shard))]


def bytes_moved(case: Case, output: Tensor, mode: str) -> int:
    """The least an op must move (the module's bytes rule): each tensor read or written once."""
    forward = sum(t.nbytes for t in case.reads) + output.nbytes
    if mode == "fwd":
        return forward
    # upstream gradient (the output's size) in, what the gradient depends on in, each input's gradient out
    return forward + output.nbytes + sum(t.nbytes for t in case.backward_reads) + sum(t.nbytes for t in case.inputs)


def copy_bandwidth(quick: bool) -> float:
    """The machine's copy bandwidth in GB/s: ``dst.copy_(src)`` over fp32 buffers, 2 x nbytes a copy."""
    n = (QUICK_COPY_BUFFER_BYTES if quick else COPY_BUFFER_BYTES) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # untimed: the first write to dst faults its pages in, which no op's round pays
    seconds: list[float] = []
    for _ in range(COPY_REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    # the median, not the best: each op's figure is a typical round's, so its denominator is a typical copy's
    return 2 * src.nbytes / statistics.median(seconds) / 1e9


def bandwidth_details(moved: int, subject_seconds: float, peer_seconds: float, copy_gbps: float) -> dict[str, Any]:
    """A row's bytes and each side's achieved GB/s as a fraction of the copy bandwidth."""
    subject_gbps, peer_gbps = moved / subject_seconds / 1e9, moved / peer_seconds / 1e9
    return {"bytes_moved": moved, "subject_GBps": round(subject_gbps, 2), "peer_GBps": round(peer_gbps, 2),
            "subject_fraction_of_copy_bandwidth": round(subject_gbps / copy_gbps, 3),
            "peer_fraction_of_copy_bandwidth": round(peer_gbps / copy_gbps, 3)}


def moonshot(row: Comparison) -> dict[str, Any]:
    """The moonshot against the compiled peer, judged on the row's own interval (informational rows judge nothing)."""
    found = verdict(row.estimate, MOONSHOT_MAX_RATIO) if row.judged else "informational"
    return {"moonshot_max_ratio": MOONSHOT_MAX_RATIO, "moonshot": found}


def check_match(ours: Callable[..., Tensor], peer: Callable[..., Tensor], leaves: tuple[Tensor, ...], grad: Tensor,
                peer_name: str) -> None:
    """The peer computes devshim's output and gradients, or the ratio compares different work."""
    tol = MATCH_TOLERANCE[leaves[0].dtype]
    for what, a, b in outputs_and_gradients(partial(ours, *leaves), partial(peer, *leaves), leaves, grad):
        scale = max(1.0, b.detach().abs().max().item())
        torch.testing.assert_close(a, b, atol=tol["atol"] * scale, rtol=tol["rtol"],
                                   msg=lambda m, what=what: f"{peer_name}, {what}: {m}")


def _time(fns: dict[str, Callable[[], object]], quick: bool) -> dict[str, list[float]]:
    """Paired rounds whose calls per figure are set by an untimed probe round (which also warms up)."""
    warmup, rounds = (QUICK_WARMUP, QUICK_ROUNDS) if quick else (WARMUP, ROUNDS)
    probe = interleaved_rounds(fns, rounds=1, warmup=warmup)
    fastest = min(figures[0] for figures in probe.values())
    calls = max(1, min(MAX_CALLS, math.ceil((QUICK_MIN_ROUND_SECONDS if quick else MIN_ROUND_SECONDS) / fastest)))
    return interleaved_rounds(fns, rounds=rounds, warmup=0, calls=calls)


@contextmanager
def _no_recompiles() -> Iterator[None]:
    """Any recompilation inside a timed round raises instead of being timed as the compiled peer's speed."""
    import torch._dynamo
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def _compiled_peer(name: str, plain: Callable[..., Tensor], leaves: tuple[Tensor, ...],
                   grad: Tensor) -> tuple[Callable[..., Tensor] | None, Note]:
    """``plain`` (whatever callable the case gives, closures included) through torch.compile, compiled now for
    both timed modes, and a Note of the compile time (or of why it could not compile)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # each case compiles afresh: earlier cases' graphs must not count towards the recompile limit
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    compiled = torch.compile(plain, dynamic=False, fullgraph=True)
    start = time.perf_counter()
    try:
        torch.autograd.grad(compiled(*leaves), leaves, grad)  # forward+backward graphs
        with torch.no_grad():
            compiled(*leaves)  # the forward-only graph, which grad mode's guard keeps apart
    except Exception as error:  # whatever dynamo or inductor raises, the peer is reported as not compiled
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        return None, Note(GROUP, f"{name}: torch.compile peer skipped, it did not compile ({reason})", math.nan, "")
    seconds = time.perf_counter() - start
    hits = counters["inductor"]["fxgraph_cache_hit"] - hits
    misses = counters["inductor"]["fxgraph_cache_miss"] - misses
    return compiled, Note(GROUP, f"{name}: torch.compile time of the plain expression, fwd+bwd and fwd graphs "
                          f"(inductor FX graph cache: {hits} hits, {misses} misses)", round(seconds, 2), "s")


def _timed_call(mode: str, fn: Callable[..., Tensor], leaves: tuple[Tensor, ...], grad: Tensor) -> Callable[[], object]:
    call = partial(fn, *leaves)
    return forward_backward(call, leaves, grad) if mode == "fwd+bwd" else forward_only(call)


def run(quick: bool = False) -> list[Result]:
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth(quick)
    size = (QUICK_COPY_BUFFER_BYTES if quick else COPY_BUFFER_BYTES) // 2**20
    results: list[Result] = [Note(GROUP, f"copy bandwidth, the denominator of each row's fractions: dst.copy_(src), "
                                  f"fp32, {size} MiB, 2 x nbytes a copy, median of {COPY_REPEATS}"
                                  + (" (quick: in the caches)" if quick else ""), round(copy_gbps, 2), "GB/s")]
    for name, make in _cases(quick):
        for dtype in (torch.float32, torch.bfloat16):
            case = make(dtype)
            leaves = tuple(t.requires_grad_() for t in case.inputs)
            with torch.no_grad():  # only its size is wanted: no graph kept alive through the case
                output = case.plain(*leaves)
            grad = torch.randn_like(output)
            dt = str(dtype).removeprefix("torch.")
            peers: dict[str, Callable[..., Tensor]] = {PLAIN: case.plain}
            if name.startswith("rms_norm"):
                peers[F_RMS_NORM] = functional_rms_norm
            if not quick:  # a quick run compiles nothing
                compiled, note = _compiled_peer(f"{name} {dt}", case.plain, leaves, grad)
                results.append(note)
                if compiled is not None:
                    peers[COMPILED] = compiled
            for peer_name, peer in peers.items():
                check_match(case.ours, peer, leaves, grad, peer_name)
            contenders = {DEVSHIM: case.ours, **peers}
            with _no_recompiles() if COMPILED in peers else nullcontext():
                fwd = _time({n: forward_only(partial(fn, *leaves)) for n, fn in contenders.items()}, quick)
                both = _time({n: forward_backward(partial(fn, *leaves), leaves, grad) for n, fn in contenders.items()},
                             quick)
            for mode, times in (("fwd+bwd", both), ("fwd", fwd)):
                with _no_recompiles() if COMPILED in peers else nullcontext():
                    kernels = {n: kernels_run(_timed_call(mode, fn, leaves, grad)) for n, fn in contenders.items()}
                moved = bytes_moved(case, output, mode)
                for peer_name in peers:
                    # a peer running what another peer runs repeats that row (torch's F.rms_norm is the plain
                    # expression on the CPU), and a peer running devshim's own kernels times them against themselves
                    repeats = peer_name != PLAIN and kernels[peer_name] == kernels[PLAIN]
                    same = kernels[peer_name] == kernels[DEVSHIM]
                    details = {"repeats": PLAIN} if repeats else {}
                    row = Comparison(GROUP, f"{name} {dt} {mode}", DEVSHIM, times[DEVSHIM], peer_name,
                                     times[peer_name], 1.0, TARGET, details, kernel_only=True,
                                     judged=not (repeats or same), subject_kernels=kernels[DEVSHIM],
                                     peer_kernels=kernels[peer_name])
                    # the row's own geometric means, so the fractions agree with the times it reports
                    row.details.update(bandwidth_details(moved, row.subject_seconds, row.peer_seconds, copy_gbps))
                    if peer_name == COMPILED:  # the estimate exists only once the row is built
                        row.details.update(moonshot(row))
                    results.append(row)
    return results
