"""A CUDA-written DeepSpeed script whose rank cannot set up its device (``test_device_faults``).

Usage: torchrun ... device_fault_job.py --marker TOKEN. Each rank calls ``torch.cuda.set_device(local_rank)``
(redirected to the selected device), then trains briefly. Before re-raising a failure, the rank prints each
applied patch set with the number of patches it declares and has applied, so the test can check none is half applied.
"""

import devshim_core.auto  # noqa: F401, I001 - first, as in a user's script

import argparse
import json
import os
import sys

import deepspeed
import torch

from devshim_core.patching import REGISTRY


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker", required=True)  # tags the processes, for the orphan check
    parser.parse_args()
    deepspeed.init_distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    try:
        torch.cuda.set_device(local_rank)
    except Exception:
        applied = {record.patch_set.name: [len(record.patch_set.patches), len(record.applied)]
                   for record in REGISTRY.applied_sets()}
        print(json.dumps({"rank": local_rank, "applied": applied}), file=sys.stderr, flush=True)
        raise
    model = torch.nn.Linear(8, 8).cuda()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}})
    loss = engine(torch.ones(2, 8).cuda()).sum()
    engine.backward(loss)
    engine.step()
    print(f"rank {local_rank} trained a step", flush=True)


if __name__ == "__main__":
    main()
