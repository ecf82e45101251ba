"""One rank of the collectives benchmark (``bench/collectives.py``), started by torchrun with 2 ranks.

For each collective, dtype and size, both contenders are timed in the same rounds, alternating which goes first:
devshim's function (``torch.distributed.<name>`` with devshim active: the header exchange, then shared memory)
and gloo's own (the function devshim wrapped). Both ranks run the same sequence, so every call meets its peer.
Rank 0 writes ``{case: {"devshim": [...], "gloo": [...]}}`` (seconds per call, one figure per round) as JSON.
"""

import devshim_core.auto  # noqa: F401, I001 - devshim first, as in a user's script

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.stats import interleaved_rounds


def gloo(function: Callable[..., Any]) -> Callable[..., Any]:
    while hasattr(function, "__devshim_original__"):
        function = function.__devshim_original__
    return function


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True, help="bytes per rank, comma-separated")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    figures: dict[str, dict[str, list[float]]] = {}
    for kind in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        ours, theirs = getattr(dist, kind), gloo(getattr(dist, kind))
        for dtype in (torch.float32, torch.bfloat16):
            for nbytes in (int(n) for n in args.sizes.split(",")):
                count = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
                part = torch.ones(count, dtype=dtype)
                whole = torch.ones(count * size, dtype=dtype)
                calls: dict[str, Callable[[], object]]
                if kind == "all_reduce":
                    calls = {"devshim": lambda: ours(part), "gloo": lambda: theirs(part)}  # noqa: B023
                else:
                    first, second = (whole, part) if kind == "all_gather_into_tensor" else (part, whole)
                    calls = {"devshim": lambda: ours(first, second), "gloo": lambda: theirs(first, second)}  # noqa: B023
                repeat = max(2, min(200, (32 << 20) // max(nbytes, 1) // 8))  # ~tens of ms per figure
                dist.barrier()
                figures[f"{kind} {str(dtype).removeprefix('torch.')} {nbytes}"] = interleaved_rounds(
                    calls, rounds=args.rounds, warmup=2, calls=repeat)
    if dist.get_rank() == 0:
        with open(args.output, "w") as f:
            json.dump(figures, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
