"""HF ``Trainer`` as a CUDA user writes it, on 2 ranks: what ``test_hf_trainer.py`` checks.

One ``torchrun`` job trains a tiny GPT-2 built from its config on synthetic tokens, through ``Trainer`` seven times,
each from the same seed: without DeepSpeed (Accelerate's DDP), and with DeepSpeed ZeRO-2, ZeRO-3, ZeRO-2 with the
optimizer offloaded to the CPU and ZeRO-3 with parameters and optimizer offloaded, all in fp32; and DDP with fp16
(Accelerate's autocast and grad scaler) and ZeRO-2 with bf16. Nothing in it names a device:
``Trainer`` and Accelerate choose. Rank 0 writes what each run chose on every rank (``TrainingArguments.device``,
Accelerate's device, backend and distributed type, where the parameters and optimizer states are, the backend of
the process group) and its per-step losses (Trainer's, the mean over ranks), and which of transformers, Accelerate,
DeepSpeed and megatron-core are installed beside it.

It has no devshim import of its own: the spec runs it through ``first_line.py`` (as if ``import devshim_core.auto``
were its first line), and, as the peer, without devshim with ``--use-cpu`` (``TrainingArguments(use_cpu=True)``, the
CPU path transformers offers without devshim; DeepSpeed has none there).

Usage: torchrun --nproc-per-node 2 [first_line.py] hf_trainer_job.py --report OUT.json [--runs NAME,...] [--use-cpu]
"""

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

STEPS = 6
# name: (ZeRO section or None for no DeepSpeed, mixed precision)
# (the runs without DeepSpeed first: after a DeepSpeed run, transformers keeps its DeepSpeed state in the process)
RUNS: dict[str, tuple[dict[str, Any] | None, str | None]] = {
    "ddp": (None, None),
    "ddp_fp16": (None, "fp16"),
    "zero2": ({"stage": 2}, None),
    "zero3": ({"stage": 3}, None),
    "zero2_offload": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, None),
    "zero3_offload": ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, None),
    "zero2_bf16": ({"stage": 2}, "bf16"),
}


def deepspeed_config(zero: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}}}


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def placement(trainer: Trainer) -> dict[str, Any]:
    """Where this rank's parameters (ZeRO-3: its partitions) and optimizer states are."""
    params = list(trainer.model_wrapped.parameters())
    partitions = [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
    optimizer = trainer.optimizer
    states = [t for state in getattr(optimizer, "state", {}).values() for t in state.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    inner = getattr(optimizer, "optimizer", None)  # DeepSpeed's ZeRO optimizer wraps the torch one
    if inner is not None:
        states += [t for state in inner.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": sorted({str(t.device) for t in (partitions or params)}),
            "parameter_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in (partitions or params)}),
            "optimizer_states": sorted({str(t.device) for t in states})}


def train(name: str, output_dir: str, use_cpu: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32))
    tokens = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    zero, precision = RUNS[name]
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4, max_steps=STEPS,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             disable_tqdm=True, use_cpu=use_cpu, fp16=precision == "fp16", bf16=precision == "bf16",
                             deepspeed=None if zero is None else deepspeed_config(zero))
    losses = Losses()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[losses])
    trainer.train()
    state = trainer.accelerator.state
    mine = {"training_arguments_device": str(args.device), "accelerator_device": str(trainer.accelerator.device),
            "accelerate_backend": state.backend, "distributed_type": str(state.distributed_type).split(".")[-1],
            "process_group_backend": dist.get_backend(), "local_rank": int(os.environ["LOCAL_RANK"]),
            "grad_scaler": type(trainer.accelerator.scaler).__name__ if trainer.accelerator.scaler else None,
            "native_amp": trainer.accelerator.native_amp,
            **placement(trainer)}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks, "losses": losses.losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--use-cpu", action="store_true")
    options = parser.parse_args()
    report: dict[str, Any] = {"installed": {}, "devshim": "devshim_core.auto" in sys.modules}
    for distribution in ("transformers", "accelerate", "deepspeed", "megatron-core"):
        try:
            report["installed"][distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            report["installed"][distribution] = None
    with tempfile.TemporaryDirectory() as output_dir:
        for name in options.runs.split(","):
            report[name] = train(name, output_dir, options.use_cpu)
    if dist.get_rank() == 0:
        with open(options.report, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
