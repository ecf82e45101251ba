"""One rank of the kit's DeepSpeed smoke run: a small MLP, ZeRO-2, fp32, data parallel over 2 ranks.

Device-neutral: it asks devshim (the public API) which device to use, never names one. Each rank writes what it
ran on, its shard losses and, from rank 0, the final parameters to ``--out``/rank<N>.json.
"""

import devshim_core.auto  # noqa: I001 - first: detect, select the plugin under test, patch

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

import devshim_core
from devshim_core.testing.smoke import STEPS, batch, config, make_mlp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    out = Path(parser.parse_args().out)
    info = devshim_core.active_session()
    assert info is not None
    local_rank = int(os.environ["LOCAL_RANK"])
    get_accelerator().set_device(local_rank)
    deepspeed.init_distributed(dist_backend=info.device["backend"])
    rank, world = dist.get_rank(), dist.get_world_size()
    fused = bool(info.device["optimizer_kernels"]["fused_adamw"])
    engine, _, _, _ = deepspeed.initialize(model=make_mlp(), model_parameters=None, config=config(world, fused))
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = [p.detach().float().cpu().tolist() for p in engine.module.parameters()]
    report = {"rank": rank, "local_rank": local_rank, "plugin": info.plugin, "device_type": info.device_type,
              "accelerator": type(get_accelerator()).__name__, "backend": dist.get_backend(),
              "param_devices": sorted({str(p.device) for p in engine.module.parameters()}),
              "optimizer": type(engine.optimizer).__name__,
              "basic_optimizer": type(engine.basic_optimizer).__name__, "fused": fused, "losses": losses,
              "params": params if rank == 0 else None}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
