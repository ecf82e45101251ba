"""One rank of the kit's Megatron smoke run: megatron-core's tensor-parallel MLP on 2 ranks (TP=2).

Each rank also computes the same MLP with the full (gathered) weights in plain PyTorch on the host, and reports
both, step by step, with the model-parallel RNG's behaviour and what devshim did with Megatron (patched through the
plugin, or, on a CUDA device, left on its own CUDA paths), to ``--out``/rank<N>.json.
"""

import devshim_core.auto  # noqa: F401, I001 - first: detect, select the plugin under test, patch

import argparse
import json
import os
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from devshim_core import session

STEPS, LR, HIDDEN, FFN, TOKENS = 4, 0.1, 16, 64, 12


def gathered(shard: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard.contiguous())
    return torch.cat(parts, dim=dim).cpu()


def rng_report(device: torch.device) -> dict[str, bool]:
    """Inside the tracker's fork, draws differ between TP ranks (each has its own stream); outside they agree."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        forked = torch.rand(64, device=device)
    default = torch.rand(64, device=device)
    forks, defaults = gathered(forked, 0).view(2, 64), gathered(default, 0).view(2, 64)
    return {"forked_draws_differ": not torch.equal(forks[0], forks[1]),
            "default_draws_agree": torch.equal(defaults[0], defaults[1]),
            "forked_on_device": forked.device == device}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    # the plugin under test, as devshim_core.auto selected it (so a session is active)
    facade = cast(session.Session, session.current()).device
    local_rank = int(os.environ["LOCAL_RANK"])
    facade.set_device(local_rank)
    device = facade.torch_device(local_rank)
    dist.init_process_group(backend=facade.collectives.backend)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    rng = rng_report(device)

    torch.manual_seed(0)  # the master weights are drawn on the host, then split (use_cpu_initialization)
    config = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True,
                                 params_dtype=torch.float32)
    init = torch.nn.init.xavier_normal_
    up = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init, bias=False, gather_output=False).to(device)
    down = RowParallelLinear(FFN, HIDDEN, config=config, init_method=init, bias=False, input_is_parallel=True,
                             skip_bias_add=True).to(device)
    w_up = gathered(up.weight.detach(), 0).requires_grad_()  # [FFN, HIDDEN]: columns are split by output rows
    w_down = gathered(down.weight.detach(), 1).requires_grad_()  # [HIDDEN, FFN]: rows are split by input columns

    generator = torch.Generator().manual_seed(7)
    losses, reference = [], []
    for _ in range(STEPS):
        x, y = torch.randn(TOKENS, HIDDEN, generator=generator), torch.randn(TOKENS, HIDDEN, generator=generator)
        hidden, _ = up(x.to(device))
        output, _ = down(F.gelu(hidden))
        loss = F.mse_loss(output, y.to(device))
        loss.backward()
        expected = F.mse_loss(F.gelu(x @ w_up.T) @ w_down.T, y)
        expected.backward()
        with torch.no_grad():
            for param in (up.weight, down.weight, w_up, w_down):
                param -= LR * cast(torch.Tensor, param.grad)  # set by the backward above
                param.grad = None
        losses.append(loss.item())
        reference.append(expected.item())

    final = {"up": (gathered(up.weight.detach(), 0) - w_up.detach()).abs().max().item(),
             "down": (gathered(down.weight.detach(), 1) - w_down.detach()).abs().max().item()}
    report = {"rank": dist.get_rank(), "local_rank": local_rank, "plugin": facade.plugin,
              "megatron_integration": cast(session.Session, session.current()).integrations.get("megatron"),
              "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
              "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
              "weight_device": str(up.weight.device), "shard_shapes": [list(up.weight.shape), list(down.weight.shape)],
              "backend": dist.get_backend(), "losses": losses, "reference_losses": reference,
              "final_weight_difference": final, "rng": rng}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
