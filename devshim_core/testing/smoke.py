"""What the kit's DeepSpeed smoke job and its host reference share: the model, the data and the optimizer."""

from __future__ import annotations

from typing import Any, cast

import torch

STEPS = 6
MICRO_BATCH = 8
LR = 1e-2


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank, and the reference, start from the same weights
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the step's global batch (``world * MICRO_BATCH`` rows, drawn on the host)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * MICRO_BATCH, 16, generator=generator)
    y = torch.randn(world * MICRO_BATCH, 4, generator=generator)
    rows = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    return x[rows], y[rows]


def config(world: int, fused: bool) -> dict[str, Any]:
    """ZeRO-2, fp32, AdamW without weight decay: DeepSpeed's FusedAdam (the plugin's kernel) when the plugin has
    one, else torch's Adam."""
    return {"train_batch_size": world * MICRO_BATCH, "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
            "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told; the reference does not clip
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": not fused}}}


def reference(world: int) -> tuple[list[list[float]], list[torch.Tensor]]:
    """The same training in one process on the host with ``torch.optim.AdamW`` on the whole global batch:
    each step's per-rank shard losses, and the final parameters."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        shards = [batch(step, rank, world) for rank in range(world)]
        per_rank = [torch.nn.functional.mse_loss(model(x), y) for x, y in shards]
        optimizer.zero_grad()
        # a Tensor: sum() of world >= 1 tensors
        (cast(torch.Tensor, sum(per_rank)) / world).backward()  # DeepSpeed averages the ranks' gradients
        optimizer.step()
        losses.append([loss.item() for loss in per_rank])
    return losses, [p.detach() for p in model.parameters()]
