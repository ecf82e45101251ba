"""One contender of ``bench/megatron_step.py``: ``examples/megatron_gpt.py``'s model, its train_step timed here.

Launched by ``torch.distributed.run`` (one process per rank). It imports the example unchanged (its first
line imports ``devshim_core.auto``), builds the model the example builds, runs ``--steps`` optimizer steps
and has rank 0 write a JSON report:

- ``step_seconds``: wall time of each ``train_step`` call on rank 0 (each step ends in an all-reduce of the
  loss and ``.item()``, so the ranks leave it together);
- ``max_rss_bytes``: every rank's ``resource.getrusage(RUSAGE_SELF).ru_maxrss``, the kernel's high-water mark
  of the process's resident set since it started (imports and model build included);
- ``max_memory_allocated``: every rank's ``torch.cuda.max_memory_allocated()`` under the redirect, which the
  cpu_reference plugin answers with the highest resident set it sampled (it samples on each such query;
  this driver queries after every step, after ``torch.cuda.reset_peak_memory_stats()`` once the model,
  its DDP buffers and optimizer are built);
- ``paths``: which implementation each fused path resolved to, so the benchmark can refuse to compare the
  wrong pair;
- ``op_self_seconds`` (only with ``--profile-step N``): rank 0's self CPU time per op during step N, recorded
  with torch.profiler (for the breakdown, never for the timed comparison: the profiler slows the step).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

# the example, unchanged; its first line imports devshim_core.auto, as a user's script does
import megatron_gpt
import torch
import torch.distributed as dist


def _where(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _paths(chunks: list[torch.nn.Module], optimizer: object) -> dict[str, object]:
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from devshim_core.session import current

    session = current()
    norms = sorted({type(m).__name__ for c in chunks for n, m in c.named_modules() if n.endswith("layernorm")})
    return {"attention_forward": _where(DotProductAttention.forward),
            "norm_classes": norms,
            "bias_swiglu_impl": _where(fused_bias_swiglu.bias_swiglu_impl),
            "rotary_bshd": _where(rope_utils._apply_rotary_pos_emb_bshd),
            "optimizers": megatron_gpt.optimizer_classes(optimizer),
            "megatron_integration": session.integrations.get("megatron") if session else None,
            "cuda_redirect": session.integrations.get("cuda-redirect") if session else None,
            "device": str(torch.empty(0, device="cuda").device)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--profile-step", type=int, default=None)
    p.add_argument("--report", required=True)
    a = p.parse_args()
    o = megatron_gpt.Options(tp=a.tp, hidden=a.hidden, heads=a.heads, seq=a.seq, layers=a.layers,
                             micro_batch=a.micro_batch, global_batch=a.global_batch, vocab=a.vocab, steps=a.steps,
                             fused=a.fused)
    megatron_gpt.init_distributed()
    megatron_gpt.init_parallel(o)
    config = megatron_gpt.transformer_config(o)
    chunks = megatron_gpt.build_model(o, config)
    chunks = megatron_gpt.wrap(o, config, chunks)
    optimizer = megatron_gpt.optimizer_for(o, chunks)
    paths = _paths(chunks, optimizer)
    torch.cuda.reset_peak_memory_stats()
    step_seconds, losses = [], []
    op_self_seconds: dict[str, float] = {}
    for step in range(o.steps):
        profiling = step == a.profile_step and dist.get_rank() == 0
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profiling else None
        if profiler is not None:
            profiler.start()
        start = time.perf_counter()
        loss, _ = megatron_gpt.train_step(o, chunks, optimizer, step)
        step_seconds.append(time.perf_counter() - start)
        if profiler is not None:
            profiler.stop()
            op_self_seconds = {e.key: e.self_cpu_time_total / 1e6 for e in profiler.key_averages()}
        losses.append(loss)
        torch.cuda.max_memory_allocated()  # cpu_reference samples the resident set when asked
    mine = {"rank": dist.get_rank(), "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "max_memory_allocated": torch.cuda.max_memory_allocated()}
    ranks: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        pathlib.Path(a.report).write_text(json.dumps(
            {"fused": o.fused, "step_seconds": step_seconds, "losses": losses, "ranks": ranks, "paths": paths,
             "world_size": dist.get_world_size(), "tp": o.tp,
             "op_self_seconds": op_self_seconds}))
    dist.barrier()
    megatron_gpt.parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
