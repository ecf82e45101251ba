"""One rank stops before an all-reduce; the others must fail within the timeout, naming it (``test_hung_collective``).

Usage: LAUNCHER ... hung_collective_job.py --timeout-s S --marker TOKEN (the marker only tags the processes, so
that the test can look for orphans).
"""

import devshim_core.auto  # noqa: F401, I001 - first, as in a user's script

import argparse
import datetime
import time

import deepspeed
import deepspeed.comm as dist
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    args = parser.parse_args()
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=args.timeout_s))
    tensor = torch.ones(4)
    dist.all_reduce(tensor)  # every rank reaches this one
    if dist.get_rank() == 1:
        print("rank 1 stops before the second all_reduce", flush=True)
        time.sleep(3600)
    print(f"rank {dist.get_rank()} enters the second all_reduce at {time.time():.3f}", flush=True)
    dist.all_reduce(tensor)


if __name__ == "__main__":
    main()
