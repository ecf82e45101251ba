"""Many megatron-core layouts in one launch (a launch costs ~10 s of imports on 2 cores), each trained from the
same initial weights on the same data, with examples/megatron_gpt.py's own building blocks.

    torchrun --nproc-per-node 1 megatron_job.py --reference --workdir W   # single-rank losses + initial weights
    torchrun --nproc-per-node 2 megatron_job.py --workdir W               # every parallel layout, then a resume
    torchrun --nproc-per-node 4 megatron_job.py --workdir W               # the 4-rank layouts (no resume)

Rank 0 writes W/<reference|parallel>.json: {layout: {"losses": [...], "grad_norms": [...]}} and the devices
every rank used.
"""

import devshim_core.auto  # noqa: F401, I001 - as in any script devshim serves: first

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import megatron_gpt as example

STEPS = 4
DENSE = example.Options(layers=4, steps=STEPS)
MOE = dataclasses.replace(DENSE, layers=2, experts=4)

# layout -> (options on 2 ranks, which single-rank model it must reproduce). The pipeline layout goes first:
# megatron-core 0.12's destroy_model_parallel leaves the position-embedding ranks of the previous layout set, and a
# pipeline layout after a non-pipeline one then finds rank 1 "in" a group it never joined.
LAYOUTS: dict[str, tuple[example.Options, str]] = {
    "pp2_vpp2": (dataclasses.replace(DENSE, pp=2, vpp=2), "dense"),
    "tp2": (dataclasses.replace(DENSE, tp=2), "dense"),
    "tp2_sp": (dataclasses.replace(DENSE, tp=2, sequence_parallel=True), "dense"),
    "recompute_full": (dataclasses.replace(DENSE, tp=2, recompute="full"), "dense"),
    "recompute_selective": (dataclasses.replace(DENSE, tp=2, sequence_parallel=True, recompute="selective"), "dense"),
    "distributed_optimizer": (dataclasses.replace(DENSE, distributed_optimizer=True), "dense"),
    "overlap_grad_reduce_param_gather": (dataclasses.replace(DENSE, distributed_optimizer=True, overlap=True),
                                         "dense"),
    "moe_ep2": (dataclasses.replace(MOE, ep=2), "moe"),
    "cp2_a2a": (dataclasses.replace(DENSE, cp=2, cp_comm_type="a2a"), "dense"),
    "cp2_p2p": (dataclasses.replace(DENSE, cp=2, cp_comm_type="p2p"), "dense"),
}
FOUR_RANK_LAYOUTS: dict[str, tuple[example.Options, str]] = {
    "cp2_tp2_p2p": (dataclasses.replace(DENSE, cp=2, tp=2, sequence_parallel=True, cp_comm_type="p2p"), "dense"),
    "cp4_a2a_p2p": (dataclasses.replace(DENSE, cp=4, cp_comm_type="a2a+p2p", hierarchical_cp="2,2"), "dense"),
}


def initial(workdir: Path, model: str) -> str:
    return str(workdir / f"initial-{model}")


def reference(workdir: Path) -> dict:
    results = {}
    for model, options in (("dense", DENSE), ("moe", MOE)):
        run = example.run(dataclasses.replace(options, save_initial=initial(workdir, model)))
        results[model] = {"losses": run["losses"], "grad_norms": run["grad_norms"],
                          "optimizers": example.optimizer_classes(run["optimizer"])}
    return results


def parallel(workdir: Path, only: list[str] | None) -> dict:
    results = {}
    four = dist.get_world_size() == 4
    for name, (options, model) in (FOUR_RANK_LAYOUTS if four else LAYOUTS).items():
        if only and name not in only:
            continue
        run = example.run(dataclasses.replace(options, load=initial(workdir, model)))
        results[name] = {"losses": run["losses"], "grad_norms": run["grad_norms"],
                         "optimizers": example.optimizer_classes(run["optimizer"]),
                         "context_parallel": context_parallel_attention(run["chunks"])}
        if dist.get_rank() == 0:
            print(f"{name}: {run['losses']}", flush=True)
    if not four and (not only or "resume" in only):
        results.update(resume(workdir))
    return results


def context_parallel_attention(chunks: list) -> list[str]:
    """How the core attention modules communicate under context parallelism (devshim's mark on each), or []."""
    from devshim_core.integrations.megatron.fused_ops import CP_COMM_TYPE

    return sorted({getattr(m, CP_COMM_TYPE) for chunk in chunks for m in chunk.modules() if hasattr(m, CP_COMM_TYPE)})


def resume(workdir: Path) -> dict:
    """DP 2 with the distributed optimizer (its Adam states sharded over the ranks): steps 0-5 straight, versus 0-2,
    a dist_checkpointing checkpoint of model and optimizer, then 3-5 in fresh objects restored from it. The two
    must agree exactly."""
    options = dataclasses.replace(DENSE, distributed_optimizer=True, load=initial(workdir, "dense"), steps=6)
    straight = example.run(options)
    checkpoint = str(workdir / "resume-checkpoint")
    first = example.run(dataclasses.replace(options, steps=3, save=checkpoint))
    second = example.run(dataclasses.replace(options, steps=3, load=None, resume=checkpoint, start_step=3))
    return {"resume_straight": {"losses": straight["losses"], "grad_norms": straight["grad_norms"]},
            "resume_split": {"losses": first["losses"] + second["losses"],
                             "grad_norms": first["grad_norms"] + second["grad_norms"]}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    example.init_distributed()
    results = reference(args.workdir) if args.reference else parallel(args.workdir, args.only)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, example.device_report())
    if dist.get_rank() == 0:
        name = "reference" if args.reference else "parallel" if dist.get_world_size() == 2 else "four"
        (args.workdir / f"{name}.json").write_text(json.dumps({"results": results, "ranks": ranks}))
    dist.barrier()
    example.parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
