"""The chaos loop's DeepSpeed job: 2 ranks, ZeRO-2, fp32, a checkpoint every ``--save-every`` steps, resume on start.

An ordinary fault-tolerant DeepSpeed script plus devshim's one line, nothing chaos-specific in its training path:
the data of step k comes from (seed, k, rank) alone, ``save_checkpoint`` stores the step as client state, and on
start ``load_checkpoint`` resumes from whatever ``latest`` names, if anything. The model has 2.6 MiB of fp32
parameters; ZeRO-2's gradient reduction and parameter all-gather go through devshim's shared-memory collectives
whenever ``/dev/shm`` has room.

It prints the lines the harness (``stress/chaos.py``) reads, one per event (:mod:`stress.chaos_protocol`).

    torchrun --nproc-per-node 2 stress/chaos_deepspeed_job.py --steps 9 --save-every 3 --save-dir DIR
"""

import devshim_core.auto  # noqa: F401, I001 - first: the only line a DeepSpeed script adds

import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script by torchrun: find stress/, tests/
from stress import chaos_protocol as say
from tests.e2e import restart_job

# the restart spec's model and data (tests/e2e/restart_job.py), wider
VOCAB, HIDDEN = 256, 256
SEED = restart_job.SEED


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return restart_job.batch(step, rank, device, vocab=VOCAB)


def main() -> None:
    args = say.job_arguments(__doc__)

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    say.started(rank)
    accel = get_accelerator()
    accel.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = accel.device(accel.current_device())
    torch.manual_seed(SEED)
    accel.manual_seed_all(SEED)

    model = restart_job.TinyLM(vocab=VOCAB, hidden=HIDDEN)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=restart_job.zero2_config(world))

    load_path, client = engine.load_checkpoint(str(args.save_dir))  # (None, None) when no `latest` exists
    start = int(client["step"]) if load_path is not None else 0
    if rank == 0:
        say.resumed(Path(load_path).parent.name, start) if load_path is not None else say.fresh()

    for step in range(start, args.steps):
        tokens, labels = batch(step, rank, device)
        loss = engine(tokens, labels)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        done = step + 1
        if rank == 0:
            say.step(done, float(mean.cpu()) / world)
        if done % args.save_every == 0 or done == args.steps:
            engine.save_checkpoint(str(args.save_dir), client_state={"step": done})
            if rank == 0:
                say.saved(f"global_step{done}")

    say.finished(rank, args.steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
