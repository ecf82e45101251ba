"""Checkpoints as a GPU cluster writes them, made on a machine without a GPU, and the jobs that load them.

Imported by the specs (``tests/test_cuda_checkpoints.py``, ``tests/emulated/test_cuda_checkpoints_emulated.py``) for
its helpers, which activate nothing (:func:`run` starts the jobs below):

- :func:`saved_on_gpu`: inside the block, ``torch.save`` tags host storages ``cuda:N``, as torch tags storages that
  live on GPU N. The storage data is the same bytes either way (torch copies a GPU storage to the host to write it);
  only the location string differs, and that string is what decides where ``torch.load`` puts it.
- :func:`storage_locations`: the location strings a ``torch.save`` file records, read from its ``data.pkl``
  without restoring any storage.

Run as a script, it is one job of its own, printing one JSON object on stdout:

- ``plain-load FILE [MAP_LOCATION]``: ``torch.load`` in a plain torch process (no devshim): the baseline.
- ``deepspeed DIR``: a CUDA-written DeepSpeed script on one rank under devshim: ZeRO-2 trains a step, saves a
  checkpoint whose every file is written as GPU 0 writes it, trains the next step; a fresh engine with other initial
  weights ``load_checkpoint``s it and trains that next step again.
- ``megatron DIR``: megatron-core's ``dist_checkpointing`` on one rank under devshim: a sharded tensor and a sharded
  object (the kind Megatron keeps RNG and optimizer extras in) saved as GPU 0 saves them, and loaded back by
  ``dist_checkpointing.load``, whose torch_dist format reads each object with ``torch.load`` and no map_location.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

# The jobs below import devshim first, as a training script does: nothing above may import torch's frameworks.
import torch

GPU_TAG_PRIORITY = 1  # ahead of every tagger torch and devshim register (cpu: 10, devshim: 18-19, cuda: 20)


@contextlib.contextmanager
def saved_on_gpu(index_of: Callable[[Any], int] = lambda storage: 0) -> Iterator[None]:
    """Inside the block ``torch.save`` tags every host storage ``cuda:<index_of(storage)>``."""

    def tag(storage: Any) -> str | None:
        return f"cuda:{index_of(storage)}" if storage.device.type == "cpu" else None

    entry = (GPU_TAG_PRIORITY, tag, lambda storage, location: None)
    torch.serialization.register_package(*entry)
    try:
        yield
    finally:
        torch.serialization._package_registry.remove(entry)


class _Anything:
    """Stands for every class a checkpoint's pickle names, so that its storages' locations can be read alone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


def storage_locations(path: str | os.PathLike[str] | IO[bytes]) -> list[str]:
    """Each storage's location string in a (zip-format) ``torch.save`` file, in the order the pickle names them."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    locations: list[str] = []

    class Reader(pickle.Unpickler):
        def persistent_load(self, saved_id: Any) -> None:
            location = saved_id[3]  # ('storage', storage type, key, location, numel)
            locations.append(location.decode() if isinstance(location, bytes) else location)

        def find_class(self, module: str, name: str) -> Any:
            return _Anything

    Reader(io.BytesIO(data)).load()
    return locations


def run(workdir: Path, *args: str, **env: str) -> dict[str, Any]:
    """This file run as one job in a fresh process (no devshim or vendor switch set but ``env``, one rank); its JSON
    report, the last line of its stdout (the frameworks log there too)."""
    import socket
    import subprocess

    from plugin_fixtures import PYTHON, TESTS_DIR, clean_env  # here: a job process never imports devshim by accident

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS_DIR),
                        TORCH_EXTENSIONS_DIR=str(workdir / "torch_extensions"), **env)  # a JIT build would land there
    proc = subprocess.run([PYTHON, __file__, *args], env=environ, cwd=workdir, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def _tensors(value: Any) -> dict[str, Any]:
    return {name: {"device": str(t.device), "values": t.tolist()} for name, t in value.items()}


# -- jobs -------------------------------------------------------------------------------------------------------------

def plain_load(path: str, map_location: str | None = None) -> dict[str, Any]:
    """torch.load with plain torch (this process never imports devshim)."""
    plain = "devshim_core" not in sys.modules
    try:
        loaded = torch.load(path, map_location=map_location)
    except Exception as exc:
        return {"plain": plain, "loaded": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"plain": plain, "loaded": _tensors(loaded), "error": None}


def deepspeed_job(directory: Path) -> dict[str, Any]:
    import devshim_core.auto  # noqa: F401, I001 - first, as in a training script

    import deepspeed
    import torch.nn.functional as F
    from torch import nn

    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}

    def engine(seed: int) -> Any:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).cuda()
        made, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return made

    def step(trained: Any, k: int) -> float:
        data = torch.Generator().manual_seed(100 + k)
        x, y = torch.randn(4, 8, generator=data).cuda(), torch.randn(4, 1, generator=data).cuda()
        loss = F.mse_loss(trained(x), y)
        trained.backward(loss)
        trained.step()
        return float(loss.item())

    saver = engine(seed=0)
    step(saver, 0)
    with saved_on_gpu():  # every file of the checkpoint as GPU 0 writes it
        saver.save_checkpoint(str(directory), tag="gpu")
    saved = {n: p.detach().clone() for n, p in saver.module.named_parameters()}
    next_loss = step(saver, 1)

    loader = engine(seed=1)  # other initial weights: only the checkpoint can make them the saved ones
    differed = any(not torch.equal(p, saved[n]) for n, p in loader.module.named_parameters())
    loader.load_checkpoint(str(directory), tag="gpu")
    loaded = dict(loader.module.named_parameters())
    return {
        "locations": {f.name: storage_locations(f) for f in sorted((directory / "gpu").glob("*.pt"))},
        "differed_before_loading": differed,
        "equal_after_loading": all(torch.equal(loaded[n].detach(), saved[n]) for n in saved),
        "param_devices": sorted({str(p.device) for p in loaded.values()}),
        "next_loss": next_loss,
        "resumed_next_loss": step(loader, 1),  # equal only if the optimizer's state came back too
    }


def _distcp_object_locations(directory: Path) -> dict[str, list[str]]:
    """The storage locations of each object (``torch.save`` bytes) that a torch DCP checkpoint holds."""
    from torch.distributed.checkpoint import FileSystemReader

    found = {}
    for index, where in FileSystemReader(str(directory)).read_metadata().storage_data.items():
        with open(directory / where.relative_path, "rb") as f:
            f.seek(where.offset)
            chunk = io.BytesIO(f.read(where.length))
        if zipfile.is_zipfile(chunk):  # tensors are raw bytes there; objects are torch.save archives
            found[index.fqn] = storage_locations(chunk)
    return found


def megatron_job(directory: Path) -> dict[str, Any]:
    import devshim_core.auto  # noqa: F401, I001 - first, as in a training script

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    directory.mkdir(parents=True, exist_ok=True)  # dist_checkpointing.save wants it there
    data = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 8, generator=data).cuda()
    extra = {"step": torch.tensor(7).cuda(), "ema": torch.randn(3, generator=data).cuda()}
    with saved_on_gpu():  # every torch.save of the checkpoint writes what GPU 0 writes
        dist_checkpointing.save({"weight": ShardedTensor.from_rank_offsets("weight", weight, replica_id=0),
                                 "extra": ShardedObject("extra", extra, (1,), (0,), replica_id=0)}, str(directory))

    template = {"weight": ShardedTensor.from_rank_offsets("weight", torch.zeros(4, 8, device="cuda"), replica_id=0),
                "extra": ShardedObject("extra", None, (1,), (0,), replica_id=0)}
    loaded = dist_checkpointing.load(template, str(directory))
    dist.destroy_process_group()
    return {
        "object_locations": _distcp_object_locations(directory),
        "weight": {"device": str(loaded["weight"].device), "equal": torch.equal(loaded["weight"], weight)},
        "extra": {name: {"device": str(t.device), "equal": torch.equal(t, extra[name])}
                  for name, t in loaded["extra"].items()},
    }


def main(argv: list[str]) -> None:
    job, target, *rest = argv
    if job == "plain-load":
        report = plain_load(target, *rest)
    elif job == "deepspeed":
        report = deepspeed_job(Path(target))
    elif job == "megatron":
        report = megatron_job(Path(target))
    else:
        raise SystemExit(f"unknown job {job!r}: plain-load, deepspeed or megatron")
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
