"""The DeepSpeed features 0.19.7/0.19.8 removed, through devshim on 2 ranks: what ``test_deepspeed_legacy.py`` checks.

Runs on a DeepSpeed that still has them (devshim's oldest supported, 0.16.0, in CI). Rank 0 writes one report:

- ``onebit``: 1-bit Adam, 0/1 Adam and 1-bit LAMB with ``comm_backend_name: compressed`` (the sign-packing all-reduce
  whose ``packbits`` op devshim serves). Each trains twice from the same weights and data: with devshim's op, and
  with a packer written on ``numpy.packbits`` (an independent implementation of the same bit layout) swapped into
  the backend. Reported: the losses of both, how far each rank's weights are from rank 0's after every step, and how
  many packs the backend made;
- ``pld``: progressive layer drop: the ``pld_theta`` DeepSpeed passes to ``forward`` at each step;
- ``curriculum_legacy``: the top-level ``curriculum_learning`` config (``seqlen``, ``fixed_linear``): the
  ``curriculum_seqlen`` passed to ``forward`` at each step.

Usage: torchrun --nproc-per-node 2 deepspeed_legacy_job.py --report OUT.json
"""

import devshim_core.auto  # noqa: F401, I001 - first: the only line a DeepSpeed script adds

import argparse
import json
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

STEPS = 8
FEATURES, HIDDEN = 16, 32
MICRO_BATCH = 4
ONEBIT = {
    "OneBitAdam": {"freeze_step": 3},
    "ZeroOneAdam": {"var_freeze_step": 3, "var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 2},
    "OneBitLamb": {"freeze_step": 3},
}
PLD = {"theta": 0.5, "gamma": 0.1}
CURRICULUM = {"min_difficulty": 2, "max_difficulty": 10, "total_curriculum_step": 8, "difficulty_step": 2}


class NumpyPacker:
    """The packbits op's contract on numpy.packbits/unpackbits: bit set for x >= 0, most significant bit first."""

    def packbits(self, tensor: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
        bits = tensor.detach().reshape(-1)[:numel].cpu().numpy() >= 0
        return torch.from_numpy(np.packbits(bits)).to(tensor.device)

    def unpackbits(self, packed: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
        raw = packed.detach().reshape(-1)[:numel].cpu().numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(raw).astype(np.float32) * 2 - 1).to(packed.device)


class CountingPacker:
    def __init__(self, inner: Any) -> None:
        self.inner, self.packs = inner, 0

    def packbits(self, *args: Any) -> torch.Tensor:
        self.packs += 1
        return self.inner.packbits(*args)

    def unpackbits(self, *args: Any) -> torch.Tensor:
        return self.inner.unpackbits(*args)


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    data = [(torch.randn(2 * MICRO_BATCH, FEATURES, generator=generator),
             torch.randn(2 * MICRO_BATCH, 1, generator=generator)) for _ in range(STEPS)]
    return [(x[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH], y[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH])
            for x, y in data]


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def spread_over_ranks(model: torch.nn.Module) -> float:
    """The largest difference between this rank's weights and rank 0's, seen by every rank."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    worst = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def run_onebit(name: str, device: torch.device, packer: str) -> dict[str, Any]:
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "steps_per_print": 10_000, "gradient_clipping": 0.0,
              "optimizer": {"type": name, "params": {"lr": 1e-2, "comm_backend_name": "compressed", **ONEBIT[name]}}}
    engine, _, _, _ = deepspeed.initialize(model=make_model(), model_parameters=None, config=config)
    backend = engine.optimizer.comm_backend_handle
    backend.packer = CountingPacker(NumpyPacker() if packer == "numpy" else backend.packer)
    losses, spreads = [], []
    for x, y in batches(dist.get_rank()):
        loss = torch.nn.functional.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        spreads.append(spread_over_ranks(engine.module))
    return {"losses": losses, "spread_over_ranks": spreads, "packs": backend.packer.packs,
            "packer": f"{type(backend.packer.inner).__module__}.{type(backend.packer.inner).__name__}"}


class Recorder(torch.nn.Module):
    """Records the keyword arguments DeepSpeed adds to ``forward`` (``pld_theta``, ``curriculum_seqlen``)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.net, self.key, self.seen = make_model(), key, []

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.seen.append(kwargs.get(self.key))
        return self.net(x)


def run_recorded(device: torch.device, key: str, extra: dict[str, Any]) -> list[Any]:
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "steps_per_print": 10_000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}
    model = Recorder(key)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=None, config=config)
    for x, y in batches(dist.get_rank()):
        loss = torch.nn.functional.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
    return [float(v) if v is not None else None for v in model.seen]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    accelerator = get_accelerator()
    accelerator.set_device(rank)
    device = torch.device(accelerator.device_name(rank))
    onebit = {name: {packer: run_onebit(name, device, packer) for packer in ("devshim", "numpy")} for name in ONEBIT}
    pld = run_recorded(device, "pld_theta", {"progressive_layer_drop": {"enabled": True, **PLD}})
    curriculum = run_recorded(device, "curriculum_seqlen", {"curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": CURRICULUM["min_difficulty"],
        "max_difficulty": CURRICULUM["max_difficulty"], "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": CURRICULUM["total_curriculum_step"],
                            "difficulty_step": CURRICULUM["difficulty_step"]}}})
    if rank == 0:
        with open(args.report, "w") as f:
            json.dump({"deepspeed": deepspeed.__version__, "device": str(device), "world": dist.get_world_size(),
                       "onebit": onebit, "pld": pld, "pld_config": PLD, "curriculum_legacy": curriculum,
                       "curriculum_config": CURRICULUM}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
