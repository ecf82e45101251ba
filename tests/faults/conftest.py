"""Fixtures the fault modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """This process as rank 0 of 1, as a launcher starts it: one process group for every engine and checkpoint call
    of the module (DeepSpeed keeps the groups it derived from the first), destroyed through deepspeed.comm, which
    also drops those groups, so that the engines of later modules start clean."""
    import deepspeed.comm
    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as env:
        for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
            env.setenv(name, value)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield
        finally:
            if deepspeed.comm.is_initialized():
                deepspeed.comm.destroy_process_group()
            if dist.is_initialized():
                dist.destroy_process_group()
