"""DeepSpeed's data-sampling curriculum learning (``data_efficiency``), a run of ``deepspeed_reference_job.py``.

The data are ``SAMPLES`` padded sequences whose difficulty (the curriculum metric, ``seqlen``) is known by
construction: sample ``i`` holds ``(i + 1) / SAMPLES`` in its first ``SEQLEN[i]`` positions and zeros after, so a
batch says which samples it holds and how long each is. DeepSpeed's ``DataAnalyzer`` computes the metric on every
rank (map) and writes its index files (reduce); the engine's ``DeepSpeedDataSampler`` then draws each step's global
batch from the samples no harder than a ``fixed_linear`` schedule allows, and broadcasts it over the device.

Reported for ``test_deepspeed_reference.py``: the analyzer's metric per sample, read back from its index files;
each step's scheduled difficulty on every rank and the (index, difficulty) of every sample each rank got; and the
losses and weights of the engine against a plain PyTorch replica trained on the batches the sampler drew. With
``curriculum=False`` the same sampler draws from all samples: the negative control of the difficulty check.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

SAMPLES, LENGTH = 64, 16
SEQLEN = np.random.default_rng(0).permutation(np.repeat(np.arange(1, LENGTH + 1), SAMPLES // LENGTH))
STEPS = 8
MICRO_BATCH = 4  # the easiest step's pool (difficulty 3: 12 samples) must hold a global batch of 8
SCHEDULE = {"min_difficulty": 2, "max_difficulty": LENGTH, "total_curriculum_step": STEPS, "difficulty_step": 1}


class PaddedSequences(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(LENGTH)
        x[:SEQLEN[index]] = (index + 1) / SAMPLES
        return x, torch.tensor([float(index % 4)])


def _seqlen(x: torch.Tensor) -> np.ndarray:
    return (x != 0).sum(dim=1).numpy().astype(np.int64)


def _index(analysis: Path, kind: str) -> str:
    """One of the analyzer's index files for the ``seqlen`` metric: ``index_to_sample`` or ``index_to_metric``."""
    return str(analysis / "seqlen" / f"seqlen_{kind}")


def analyze(folder: Path) -> list[int]:
    """Run DeepSpeed's DataAnalyzer over the data, one map worker per rank; the metric it indexed, per sample."""
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)  # the analyzer appends to what it finds
    dist.barrier()
    # the collate function keeps x alone: the analyzer counts samples by len(batch), which is 2 for an (x, y) pair
    DataAnalyzer(PaddedSequences(), num_workers=world, worker_id=rank, batch_size=8, metric_names=["seqlen"],
                 metric_functions=[_seqlen], metric_types=["single_value_per_sample"], metric_dtypes=[np.int64],
                 save_path=str(folder), collate_fn=lambda pairs: torch.stack([x for x, _ in pairs])).run_map_reduce()
    dist.barrier()
    to_sample = MMapIndexedDataset(_index(folder, "index_to_sample"), skip_warmup=True)
    to_metric = MMapIndexedDataset(_index(folder, "index_to_metric"), skip_warmup=True)
    metric = [-1] * SAMPLES
    for row in range(len(to_sample)):
        for sample in to_sample[row]:
            metric[int(sample)] = int(to_metric[row][0])
    return metric


def _config(base: dict[str, Any], analysis: Path, clusters: Path, curriculum: bool) -> dict[str, Any]:
    metric = {"index_to_sample_path": _index(analysis, "index_to_sample"),
              "index_to_metric_path": _index(analysis, "index_to_metric"),
              "difficulty_type": "value", "clustering_type": "schedule_based", "schedule_type": "fixed_linear",
              "min_difficulty": SCHEDULE["min_difficulty"], "max_difficulty": SCHEDULE["max_difficulty"],
              "schedule_config": {k: SCHEDULE[k] for k in ("total_curriculum_step", "difficulty_step")}}
    sampling = {"enabled": True, "num_workers": 0, "curriculum_learning": {
        "enabled": curriculum, "data_cluster_path": str(clusters), "curriculum_metrics": {"seqlen": metric}}}
    return {**base, "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "data_efficiency": {"enabled": True, "seed": 1234, "data_sampling": sampling}}


def _decode(x: torch.Tensor) -> list[list[int]]:
    """(sample index, difficulty) of each row, read from the batch's content alone."""
    return [[round(float(row.max()) * SAMPLES) - 1, int((row != 0).sum())] for row in x]


def run_curriculum_sampling(workdir: Path, device: torch.device, base_config: dict[str, Any],
                            make_model: Callable[[], torch.nn.Module], curriculum: bool,
                            analysis: Path) -> dict[str, Any]:
    import deepspeed  # here: the test imports this module's constants without DeepSpeed's start-up

    rank, world = dist.get_rank(), dist.get_world_size()
    clusters = workdir / f"curriculum-clusters-{'on' if curriculum else 'off'}"
    if rank == 0:
        shutil.rmtree(clusters, ignore_errors=True)
    dist.barrier()
    engine, _, loader, _ = deepspeed.initialize(model=make_model(), model_parameters=None,
                                                training_data=PaddedSequences(),
                                                config=_config(base_config, analysis, clusters, curriculum))
    sampler_state: dict[str, Any] = {}
    engine.set_data_post_process_func(lambda batch, state: (sampler_state.update(state), batch)[1])
    steps, drawn = [], []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        difficulty = sampler_state.get("current_difficulties", {}).get("seqlen")
        steps.append({"scheduled": difficulty, "samples": _decode(x), "loss": total.item() / world})
        drawn.append((x, y))
        if len(steps) == STEPS:
            break
    every_rank: list[Any] = [None] * world
    dist.all_gather_object(every_rank, (steps, drawn))
    parameters = [p.detach().float().cpu().flatten().tolist() for p in engine.module.parameters()]
    reference = _replica(base_config, make_model, [[every_rank[r][1][s] for r in range(world)] for s in range(STEPS)])
    return {"steps": [{"scheduled": [every_rank[r][0][s]["scheduled"] for r in range(world)],
                       "samples": [every_rank[r][0][s]["samples"] for r in range(world)],
                       "loss": steps[s]["loss"]} for s in range(STEPS)],
            "parameters": parameters, "reference": reference}


def _replica(config: dict[str, Any], make_model: Callable[[], torch.nn.Module],
             drawn: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, Any]:
    """Plain PyTorch on the host, one process: AdamW and clipping as configured, on each step's global batch."""
    model = make_model()
    params = config["optimizer"]["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                                  weight_decay=params["weight_decay"])
    losses = []
    for parts in drawn:  # every rank's micro-batch has MICRO_BATCH samples: the global mean is the mean of the means
        x, y = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "parameters": [p.detach().flatten().tolist() for p in model.parameters()]}
