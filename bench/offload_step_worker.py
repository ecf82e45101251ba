"""One rank of one contender of ``bench/offload_step.py``: a ZeRO-2 bf16 engine with the optimizer offloaded.

``--contender devshim`` imports ``devshim_core.auto`` (cpu_reference, the one-pass step); ``--contender deepspeed``
never imports devshim and runs DeepSpeed's own CPU accelerator (``DS_ACCELERATOR=cpu``, its JIT-built
``cpu_adam``). Rank 0 reads commands on stdin and passes them to the other ranks: ``run K`` trains K steps and
prints, as one JSON line after ``BENCH``, each step's wall time, the time of its ``engine.step()`` (the optimizer
step: host Adam, the copies to the device weights, the all-gather), and its loss; ``quit`` ends. The engine is
built and warmed up before the first ``ready`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contender", choices=("deepspeed", "devshim"), required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.contender == "devshim":
        import devshim_core.auto  # noqa: F401
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 1 << 30,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inputs = torch.randn(2, args.width, generator=torch.Generator().manual_seed(rank)).to(engine.device,
                                                                                        torch.bfloat16)

    def train(steps: int) -> dict[str, list[float]]:
        walls, optimizer_steps, losses = [], [], []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            loss = engine(inputs).float().pow(2).mean()
            engine.backward(loss)
            before_step = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            walls.append(end - start)
            optimizer_steps.append(end - before_step)
            losses.append(loss.item())
        return {"seconds": walls, "optimizer_step_seconds": optimizer_steps, "losses": losses}

    train(args.warmup)
    op = getattr(engine.optimizer.optimizer, "ds_opt_adam", None)
    one_pass = getattr(engine.optimizer, "devshim_one_pass", None)
    if rank == 0:
        print("BENCH", json.dumps({"ready": True, "parameters": sum(p.numel() for p in model.parameters()),
                          "cpu_adam_op": type(op).__module__ if args.contender == "devshim" else str(op),
                          "one_pass_copies": None if one_pass is None else one_pass.written}), flush=True)
    while True:
        command = [sys.stdin.readline().strip() if rank == 0 else ""]
        dist.broadcast_object_list(command, src=0)
        verb, _, count = command[0].partition(" ")
        if verb != "run":
            break
        measured = train(int(count))
        if rank == 0:
            print("BENCH", json.dumps(measured), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
