"""DeepSpeed through devshim against plain PyTorch, on 2 ranks: what ``test_deepspeed_reference.py`` checks.

One ``torchrun`` job trains the same seeded model on the same data several ways, each from the same initial
weights, and rank 0 writes every run's per-step losses (mean over ranks) and final parameters:

- ``reference``: ``DistributedDataParallel`` + ``torch.optim.AdamW`` + ``clip_grad_norm_``, no DeepSpeed;
- ``zero0`` .. ``zero3``: ``deepspeed.initialize`` with fp32, the same AdamW settings and clipping (DeepSpeed 0.19
  clips at 1.0 unless told otherwise), ZeRO stage 0-3;
- ``gas1_mb8`` and ``gas2_mb4``: ZeRO-1, one micro-batch of 8 per rank per step against two of 4 (the same 8
  samples, split);
- ``fp16_overflow``: ZeRO-1 with fp16 and a dynamic loss scale; the input of step ``OVERFLOW_STEP`` holds an
  inf, so its gradients overflow;
- ``dropout_checkpointed`` / ``dropout_not_checkpointed``: two blocks with dropout, through
  ``deepspeed.checkpointing.checkpoint`` or not (ZeRO-1, fp32, the same seeds), and checkpointed with other seeds;
- ``resumes``: with dropout, a run uninterrupted against one checkpointed after ``SAVE_AFTER`` steps and resumed
  by a fresh engine: ZeRO-2 + CPU offload + a warm-up/decay LR schedule, ZeRO-1 bf16, and ZeRO-1 fp16 after an
  overflow (a loss scale that is no longer the initial one);
- ``infinity``: ZeRO-Infinity, ZeRO-3 with parameters and optimizer state offloaded to the CPU and to NVMe (files in
  a local directory, through devshim's ``async_io`` op), against the same model kept on the device;
- ``portable``: ZeRO-1 fp32 uninterrupted, and a checkpoint after ``SAVE_AFTER`` steps that a job on another
  device resumes; ``zero3`` also leaves its final checkpoint, for the conversion tools;
- ``curriculum_sampling``: data-sampling curriculum learning (``curriculum_sampling.py``), with the curriculum on
  and, as the negative control, off;
- ``moe``: an MoE layer with expert parallel 2 against the same network computed whole in one process;
- ``autotp``: ``deepspeed.init_inference`` with tensor parallel 2 (AutoTP) against the unsharded model's logits;
- ``one_pass_offload``: ZeRO-2 bf16 with the optimizer offloaded, devshim's one-pass step (the host Adam writes the
  bf16 copy) against DeepSpeed's two-pass step (the set reverted): each rank's fp32 master partitions, Adam states
  and bf16 weights compared with ``torch.equal``;
- ``pipeline``: two pipeline stages, one per rank, against the same model trained whole with plain PyTorch.

``--load-foreign DIR`` alone: resume another device's ``portable`` checkpoint here. ``--load-universal DIR`` and
``--load-fp32 FILE``, without the runs: load a universal checkpoint into ZeRO-3, and a ``zero_to_fp32`` state dict
into ZeRO-1, and report the weights (any world size).

Usage: torchrun --nproc-per-node 2 deepspeed_reference_job.py --report OUT.json [--load-foreign DIR |
[--load-universal DIR] [--load-fp32 FILE]]
"""

import devshim_core.auto  # noqa: F401, I001 - first: the only line a DeepSpeed script adds

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from curriculum_sampling import analyze, run_curriculum_sampling

STEPS = 6
MICRO_BATCH = 8
FEATURES, HIDDEN, VOCAB = 16, 32, 50
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
OVERFLOW_STEP = 2
INITIAL_SCALE_POWER = 8
SAVE_AFTER = 3
DROPOUT = 0.1
CLIP = 1.0  # DeepSpeed 0.19's default; the gradient norm exceeds it on some steps here, not on others


def make_model(dropout: float = 0.0, seed: int = 1234) -> torch.nn.Module:
    torch.manual_seed(seed)  # every run starts from these weights, unless it loads others
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(HIDDEN, 1))


class CheckpointedBlocks(torch.nn.Module):
    """Two blocks with dropout, run through ``deepspeed.checkpointing.checkpoint`` or directly."""

    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.checkpointing = checkpointing
        self.inp = torch.nn.Linear(FEATURES, HIDDEN)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Dropout(0.2))
            for _ in range(2))
        self.out = torch.nn.Linear(HIDDEN, 1)
        self.block_forwards = 0
        for block in self.blocks:
            block.register_forward_hook(lambda *_: setattr(self, "block_forwards", self.block_forwards + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.checkpointing else block(x)
        return self.out(x)


def run_checkpointing(data: list, device: torch.device, checkpointing: bool, seed: int = 200) -> dict[str, Any]:
    model = CheckpointedBlocks(checkpointing)
    engine = deepspeed.initialize(model=model, model_parameters=None, config=ds_config(1, MICRO_BATCH, 1))[0]
    seed_everything(seed + dist.get_rank())
    losses = train(engine, data, range(STEPS), device)
    return {"losses": losses, "parameters": host_parameters(model),
            "block_forwards_per_step": model.block_forwards / STEPS}


def batches(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's micro-batch of MICRO_BATCH samples for ``rank`` (the global batch is split by rank)."""
    generator = torch.Generator().manual_seed(99)
    steps = []
    for _ in range(STEPS):
        x = torch.randn(world * MICRO_BATCH, FEATURES, generator=generator)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        steps.append((x[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH], y[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]))
    return steps


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def max_over_ranks(value: torch.Tensor) -> float:
    largest = value.detach().float().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def trained_parameters(engine: Any) -> list[list[float]]:
    """The engine's weights on the host, gathered first when ZeRO-3 partitions them."""
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return host_parameters(engine.module)
    return host_parameters(engine.module)


def host_parameters(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().float().cpu().flatten().tolist() for p in model.parameters()]


def run_reference(data: list, device: torch.device) -> dict[str, Any]:
    model = make_model().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses: list[float] = []
    norms: list[float] = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        losses.append(mean_over_ranks(loss))
    return {"losses": losses, "grad_norms": norms, "parameters": host_parameters(model)}


def ds_config(stage: int, micro_batch: int, accumulation: int, fp16: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
        "steps_per_print": 10_000,
    }
    if fp16:  # hysteresis 1: the first overflow halves the scale
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_SCALE_POWER,
                          "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
    return config


def train(engine: Any, data: list, steps: range, device: torch.device, overflow_step: int | None = None,
          on_step: Callable[[int, Any], None] | None = None) -> list[float]:
    """Train ``steps`` of ``data``; each step's loss, averaged over micro-batches and ranks."""
    accumulation = engine.gradient_accumulation_steps()
    losses = []
    for step in steps:
        x, y = (t.to(device) for t in data[step])
        if step == overflow_step:
            x = x.clone()
            x[0, 0] = float("inf")
        step_losses = []
        for part_x, part_y in zip(x.chunk(accumulation), y.chunk(accumulation), strict=True):
            out = engine(part_x.to(next(engine.module.parameters()).dtype))
            loss = torch.nn.functional.mse_loss(out.float(), part_y)
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.detach())
        losses.append(mean_over_ranks(torch.stack(step_losses).mean()))
        if on_step is not None:
            on_step(step, engine)
    return losses


def run_deepspeed(data: list, device: torch.device, config: dict[str, Any],
                  on_step: Callable[[int, Any], None] | None = None, save_to: str | None = None) -> dict[str, Any]:
    engine, _, _, _ = deepspeed.initialize(model=make_model(), model_parameters=None, config=config)
    losses = train(engine, data, range(STEPS), device, OVERFLOW_STEP if config.get("fp16") else None, on_step)
    if save_to is not None:  # tag: the ZeRO stage
        engine.save_checkpoint(save_to, tag=f"zero{config['zero_optimization']['stage']}")
    return {"losses": losses, "parameters": trained_parameters(engine), "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps}


class MoENet(torch.nn.Module):
    """A layer of two linear experts, one per rank (expert parallel 2), top-1 routing, no token dropped."""

    def __init__(self) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(1234)
        self.inp = torch.nn.Linear(FEATURES, HIDDEN)
        self.moe = MoE(hidden_size=HIDDEN, expert=torch.nn.Linear(HIDDEN, HIDDEN), num_experts=2, ep_size=2, k=1,
                       min_capacity=0, drop_tokens=False)
        self.out = torch.nn.Linear(HIDDEN, 1)
        self.tokens_per_expert: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _aux_loss, counts = self.moe(self.inp(x))
        self.tokens_per_expert = [int(c) for c in counts]
        return self.out(hidden)


def run_moe(device: torch.device) -> dict[str, Any]:
    """MoE with expert parallel 2 through DeepSpeed against the same network computed whole in this process:
    both experts (gathered from the two ranks), DeepSpeed's top-1 gate (softmax of the gate's logits, each token
    to its argmax expert, scaled by that probability), the loss averaged over the ranks, torch.optim.AdamW."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    net = MoENet()
    expert = net.moe.deepspeed_moe.experts.deepspeed_experts[0]
    torch.manual_seed(10 + rank)  # each rank's expert its own weights: a token sent to the wrong one shows
    expert.reset_parameters()
    net.to(device)
    gathered = {}
    for name in ("weight", "bias"):
        mine = getattr(expert, name).detach().contiguous()
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        gathered[name] = parts
    shared = {n: p.detach().clone().requires_grad_(True) for n, p in net.named_parameters()
              if "deepspeed_experts" not in n}
    experts = [(w.clone().requires_grad_(True), b.clone().requires_grad_(True))
               for w, b in zip(gathered["weight"], gathered["bias"], strict=True)]
    F = torch.nn.functional

    def whole(x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, shared["inp.weight"], shared["inp.bias"])
        gates = torch.softmax(F.linear(h.float(), shared["moe.deepspeed_moe.gate.wg.weight"]), dim=1)
        chosen = gates.argmax(dim=1)
        outputs = torch.stack([F.linear(h, w, b) for w, b in experts], dim=1)
        mixed = gates.gather(1, chosen[:, None]) * outputs[torch.arange(len(chosen), device=x.device), chosen]
        return F.linear(mixed, shared["out.weight"], shared["out.bias"])

    optimizer = torch.optim.AdamW([*shared.values(), *(t for pair in experts for t in pair)], **ADAMW)
    config = ds_config(0, MICRO_BATCH, 1)
    config["gradient_clipping"] = 0.0
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "all"})
    engine = deepspeed.initialize(model=net, model_parameters=groups, config=config)[0]
    losses, reference_losses, routed = [], [], []
    for x, y in batches(0, 1):  # the global batch; each rank trains on its half
        x, y = x.to(device), y.to(device)
        mine = slice(rank * MICRO_BATCH // world, (rank + 1) * MICRO_BATCH // world)
        loss = F.mse_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss))
        routed.append(net.tokens_per_expert)
        out = whole(x)
        halves = [F.mse_loss(out[r * MICRO_BATCH // world:(r + 1) * MICRO_BATCH // world],
                             y[r * MICRO_BATCH // world:(r + 1) * MICRO_BATCH // world]) for r in range(world)]
        reference = sum(halves) / world
        optimizer.zero_grad()
        reference.backward()
        optimizer.step()
        reference_losses.append(reference.item())
    pairs = [(p, shared[n]) for n, p in net.named_parameters() if n in shared]
    pairs += [(expert.weight, experts[rank][0]), (expert.bias, experts[rank][1])]
    worst = max_over_ranks(max((a.detach() - b.detach()).abs().max() for a, b in pairs))
    return {"losses": losses, "reference_losses": reference_losses, "max_weight_difference": worst,
            "tokens_per_expert": routed, "experts_differ": not torch.equal(*gathered["weight"])}


def run_pipeline(device: torch.device) -> dict[str, Any]:
    """Two pipeline stages, one per rank, each step 2 micro-batches of 4, against the same model trained whole in
    this process with plain PyTorch (AdamW, the loss averaged over the micro-batches). Each rank compares the
    layers it holds; the largest difference over both ranks is reported.

    Without clipping: DeepSpeed 0.19's clip_grad_norm_ counts only model-parallel rank 0's parameters unless
    they are marked model-parallel, so stage 1's gradients are missing from the norm it clips by (on any device).
    """
    from deepspeed.pipe import PipelineModule

    data = [(x.to(device), y.to(device)) for x, y in batches(0, 1)]  # the whole global batch, every step
    half = MICRO_BATCH // 2
    reference = make_model().to(device)
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    reference_losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(reference(px), py) for px, py in zip(x.split(half), y.split(half),
                                                                                    strict=True)) / 2
        loss.backward()
        optimizer.step()
        reference_losses.append(loss.item())

    pipe = PipelineModule(layers=list(make_model()), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                          partition_method="uniform")
    config = ds_config(0, half, 2)
    config.update(train_batch_size=MICRO_BATCH, gradient_clipping=0.0)
    engine = deepspeed.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()], config=config)[0]
    losses = [float(engine.train_batch(data_iter=iter(list(zip(x.split(half), y.split(half), strict=True)))))
              for x, y in data]
    mine = [p for i in range(pipe._local_start, pipe._local_stop) for p in reference[i].parameters()]
    worst = max_over_ranks(max((a.detach() - b.detach()).abs().max()
                               for a, b in zip(pipe.parameters(), mine, strict=True)))
    return {"losses": losses, "reference_losses": reference_losses, "max_weight_difference": worst,
            "stage_layers": [pipe._local_start, pipe._local_stop]}


class TinyModel(torch.nn.Module):
    """A decoder-shaped model AutoTP recognises without a policy: a ModuleList of blocks whose down_proj is the
    row-parallel linear (its output all-reduced), up_proj column-parallel; 'Model' in the class name."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up_proj = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
            self.down_proj = torch.nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down_proj(torch.nn.functional.gelu(self.up_proj(x)))

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(TinyModel.Block() for _ in range(2))
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def run_autotp(device: torch.device) -> dict[str, Any]:
    """deepspeed.init_inference with tensor parallel 2 (AutoTP) against the unsharded model's logits."""
    # DeepSpeed 0.19's AutoTP imports transformers whatever the model; a user installs it, these tests use the
    # import-only stand-in (tests/e2e/standins), which no code path here calls into
    sys.path.insert(0, str(Path(__file__).resolve().parent / "standins"))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    whole = TinyModel().to(device).eval()
    with torch.no_grad():
        want = whole(ids)
    engine = deepspeed.init_inference(TinyModel().eval(), tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    with torch.no_grad():
        got = engine(ids)
    up = engine.module.layers[0].up_proj
    return {"max_logit_difference": max_over_ranks((got.float() - want.float()).abs().max()),
            "up_proj_out_features": up.weight.shape[0],
            "down_proj_class": type(engine.module.layers[0].down_proj).__name__,
            "logits_device": str(got.device)}


WIDE = 1024  # ZeRO-Infinity swaps only partitions of 1 MiB or more: the middle layer's half is 2 MiB


def run_infinity(data: list, device: torch.device, offload: str | None, nvme: Path) -> dict[str, Any]:
    """ZeRO-3 on a model wide enough to be swapped, with parameters and optimizer state offloaded to ``offload``
    ("cpu", "nvme": files under ``nvme``) or kept on the device (``None``). Reports the losses and, instead of
    a million weights, their bytes' SHA-256 and the gathered weights for the caller to compare."""
    config = ds_config(3, MICRO_BATCH, 1)
    config["optimizer"]["params"]["lr"] = 1e-4  # the wide layer diverges at the small model's 1e-2
    zero = config["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = 0  # every parameter is partitioned, so every one is offloaded
    if offload is not None:
        where = {"device": offload, "pin_memory": True}
        if offload == "nvme":
            where["nvme_path"] = str(nvme)
        zero["offload_param"] = {**where, "buffer_count": 5, "buffer_size": WIDE * WIDE, "max_in_cpu": 0}
        zero["offload_optimizer"] = {**where, "buffer_count": 4}
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                         "single_submit": False, "overlap_events": True}
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, WIDE), torch.nn.Tanh(), torch.nn.Linear(WIDE, WIDE),
                                torch.nn.Tanh(), torch.nn.Linear(WIDE, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=None, config=config)
    losses = train(engine, data, range(STEPS), device)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = torch.cat([p.detach().float().cpu().flatten() for p in engine.module.parameters()])
    swap_files = sorted((str(f.relative_to(nvme)), f.stat().st_size) for f in nvme.rglob("*.swp")) \
        if offload == "nvme" else []
    handles = {type(h).__module__ for h in _aio_handles(engine)}
    return {"losses": losses, "weights": weights, "swap_files": swap_files, "aio_handle_modules": sorted(handles),
            "skipped_steps": engine.skipped_steps}


def _aio_handles(engine: Any) -> list[Any]:
    """The async-I/O handles ZeRO-Infinity's parameter and optimizer swappers hold."""
    optimizer = engine.optimizer
    found = []
    for swapper in (getattr(optimizer, "optimizer_swapper", None),
                    getattr(getattr(optimizer, "parameter_offload", None), "param_swapper", None)):
        for name in ("aio_handle", "aio_read_handle", "aio_write_handle"):
            handle = getattr(swapper, name, None)
            if handle is not None and not isinstance(handle, type):
                found.append(handle)
    return found


def compare_infinity(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Reduce the three ZeRO-Infinity runs to what the spec checks: losses, swap files, handles, and how far
    each offloaded run's final weights are from the one kept on the device (and NVMe's from CPU's)."""
    base = runs["device"]["weights"]

    def digest(weights: torch.Tensor) -> str:
        return hashlib.sha256(weights.numpy().tobytes()).hexdigest()

    return {name: {"losses": run["losses"], "weights_sha256": digest(run["weights"]),
                   "max_weight_difference_from_device": float((run["weights"] - base).abs().max()),
                   "max_weight_difference_from_cpu_offload":
                       float((run["weights"] - runs["cpu"]["weights"]).abs().max()) if "cpu" in runs else None,
                   "swap_files": run["swap_files"], "aio_handle_modules": run["aio_handle_modules"],
                   "skipped_steps": run["skipped_steps"], "parameters_count": run["weights"].numel()}
            for name, run in runs.items()}


def run_portable(data: list, device: torch.device, checkpoints: str) -> dict[str, Any]:
    """ZeRO-1 fp32 without dropout: the losses of an uninterrupted run, and a checkpoint after SAVE_AFTER steps
    (tag 'portable') that a job on another device loads (``--load-foreign``)."""
    config = ds_config(1, MICRO_BATCH, 1)
    whole = deepspeed.initialize(model=make_model(), model_parameters=None, config=config)[0]
    uninterrupted = train(whole, data, range(STEPS), device)
    first = deepspeed.initialize(model=make_model(), model_parameters=None, config=config)[0]
    train(first, data, range(SAVE_AFTER), device)
    first.save_checkpoint(checkpoints, tag="portable")
    return {"uninterrupted": uninterrupted}


def load_foreign(data: list, device: torch.device, checkpoints: str) -> dict[str, Any]:
    """Resume another device's 'portable' checkpoint here, from other weights, and train the remaining steps."""
    engine = deepspeed.initialize(model=make_model(seed=99), model_parameters=None,
                                  config=ds_config(1, MICRO_BATCH, 1))[0]
    engine.load_checkpoint(checkpoints, tag="portable")
    return {"losses": train(engine, data, range(SAVE_AFTER, STEPS), device),
            "parameter_devices": sorted({str(p.device) for p in engine.module.parameters()})}


def load_universal(folder: Path) -> dict[str, Any]:
    """Load a universal checkpoint (``ds_to_universal`` of a ZeRO-3 run on another world size) into ZeRO-3."""
    config = ds_config(3, MICRO_BATCH, 1)
    config["checkpoint"] = {"load_universal": True}
    engine = deepspeed.initialize(model=make_model(seed=99), model_parameters=None, config=config)[0]
    engine.load_checkpoint(str(folder.parent), tag=folder.name)
    states = engine.optimizer.optimizer.state.values()
    return {"parameters": trained_parameters(engine), "global_steps": engine.global_steps,
            "adam_states_nonzero": bool(states) and all(bool(s["exp_avg"].any()) for s in states)}


def load_fp32(path: Path) -> dict[str, Any]:
    """Load ``zero_to_fp32``'s state dict (of a ZeRO-3 run on another world size) into a ZeRO-1 engine."""
    model = make_model(seed=99)
    model.load_state_dict(torch.load(path, weights_only=True))
    engine = deepspeed.initialize(model=model, model_parameters=None, config=ds_config(1, MICRO_BATCH, 1))[0]
    return {"parameters": trained_parameters(engine), "zero_stage": engine.zero_optimization_stage()}


def run_offload_bf16(data: list, device: torch.device) -> tuple[dict[str, list[torch.Tensor]], Any]:
    """ZeRO-2 bf16 with the optimizer on the host: this rank's tensors after ``STEPS`` steps, and its counts of
    one-pass copies (``None`` when devshim's one-pass step never ran)."""
    config = ds_config(2, MICRO_BATCH, 1)
    config["bf16"] = {"enabled": True}
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine, _, _, _ = deepspeed.initialize(model=make_model(), model_parameters=None, config=config)
    train(engine, data, range(STEPS), device)
    optimizer = engine.optimizer
    states = [optimizer.optimizer.state[p] for p in optimizer.single_partition_of_fp32_groups]
    tensors = {"fp32_master": [p.detach().clone() for p in optimizer.single_partition_of_fp32_groups],
               "exp_avg": [s["exp_avg"].clone() for s in states],
               "exp_avg_sq": [s["exp_avg_sq"].clone() for s in states],
               "bf16_weights": [p.detach().cpu().clone() for p in engine.module.parameters()]}
    counts = getattr(optimizer, "devshim_one_pass", None)
    return tensors, None if counts is None else {"written": counts.written, "skipped": counts.skipped}


def run_one_pass_offload(data: list, device: torch.device) -> dict[str, Any]:
    """One-pass against two-pass: the second run has devshim's set reverted, so DeepSpeed converts as it ships."""
    from devshim_core.patching import REGISTRY

    one_pass, one_pass_counts = run_offload_bf16(data, device)
    reverted = REGISTRY.revert("deepspeed-zero-offload-one-pass")
    two_pass, two_pass_counts = run_offload_bf16(data, device)
    equal = {name: all(torch.equal(a, b) for a, b in zip(one_pass[name], two_pass[name], strict=True))
             for name in one_pass}
    unequal_ranks = {name: int(max_over_ranks(torch.tensor(float(not same), device=device)))
                     for name, same in equal.items()}
    return {"identical_on_every_rank": {name: not bad for name, bad in unequal_ranks.items()},
            "elements": {name: sum(t.numel() for t in one_pass[name]) for name in one_pass},
            "groups": len(one_pass["fp32_master"]), "steps": STEPS, "reverted": reverted,
            "one_pass_counts": one_pass_counts, "two_pass_counts": two_pass_counts}


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    get_accelerator().manual_seed(seed)


def run_resume(data: list, device: torch.device, config: dict[str, Any], checkpoints: str, tag: str,
               overflow_step: int | None = None, control: bool = False) -> dict[str, Any]:
    """Uninterrupted, against: SAVE_AFTER steps, a checkpoint (plus each rank's RNG state, as a script saves it
    through the accelerator), and a restart from other weights and another RNG state that loads both.
    ``control``: also resume without restoring the RNG state, which dropout must make differ."""
    rank = dist.get_rank()
    accelerator = get_accelerator()

    def engine() -> Any:
        return deepspeed.initialize(model=make_model(DROPOUT), model_parameters=None, config=config)[0]

    lrs: list[float] = []
    scales: list[float] = []

    def watch(step: int, e: Any) -> None:
        lrs.append(e.get_lr()[0])
        scales.append(float(getattr(e.optimizer, "cur_scale", 1.0)))

    seed_everything(100 + rank)
    uninterrupted = train(engine(), data, range(STEPS), device, overflow_step, watch)
    seed_everything(100 + rank)
    first = engine()
    train(first, data, range(SAVE_AFTER), device, overflow_step)
    first.save_checkpoint(checkpoints, tag=tag)
    rng_file = f"{checkpoints}/{tag}/rng_rank{rank}.pt"
    torch.save({"host": torch.get_rng_state(), "device": accelerator.get_rng_state()}, rng_file)
    saved_scale = float(getattr(first.optimizer, "cur_scale", 1.0))
    del first

    def restarted(restore_rng: bool) -> tuple[Any, float]:
        seed_everything(7)  # a restarted process: other RNG state ...
        with torch.random.fork_rng(devices=[]):
            e = deepspeed.initialize(model=make_model(DROPOUT, seed=99), model_parameters=None, config=config)[0]
        e.load_checkpoint(checkpoints, tag=tag)  # ... and other weights, until the checkpoint is loaded
        if restore_rng:
            state = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(state["host"])
            accelerator.set_rng_state(state["device"])
        return e, float(getattr(e.optimizer, "cur_scale", 1.0))

    resumed_engine, scale_after_load = restarted(restore_rng=True)
    resumed = train(resumed_engine, data, range(SAVE_AFTER, STEPS), device, overflow_step)
    result = {"uninterrupted": uninterrupted, "resumed": resumed, "lrs": lrs, "scales": scales,
              "saved_scale": saved_scale, "scale_after_load": scale_after_load}
    del resumed_engine
    if control:
        control_engine, _ = restarted(restore_rng=False)
        result["resumed_without_rng"] = train(control_engine, data, range(SAVE_AFTER, STEPS), device, overflow_step)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--load-foreign", metavar="DIR", help="only resume the 'portable' checkpoint in DIR")
    parser.add_argument("--load-universal", metavar="DIR", type=Path, help="only load this universal checkpoint")
    parser.add_argument("--load-fp32", metavar="FILE", type=Path, help="only load this fp32 state dict")
    args = parser.parse_args()
    deepspeed.init_distributed()
    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    accelerator = get_accelerator()
    accelerator.set_device(rank)
    device = torch.device(accelerator.device_name(rank))
    data = batches(rank, world)
    if args.load_foreign or args.load_universal or args.load_fp32:
        loaded = load_foreign(data, device, args.load_foreign) if args.load_foreign else {}
        if args.load_universal:
            loaded["universal"] = load_universal(args.load_universal)
        if args.load_fp32:
            loaded["fp32"] = load_fp32(args.load_fp32)
        if rank == 0:
            with open(args.report, "w") as f:
                json.dump({"world": world, "device": str(device), "loaded": loaded}, f)
        dist.barrier()
        return
    checkpoints = str(Path(args.report).parent / "checkpoints")
    runs: dict[str, Any] = {"reference": run_reference(data, device)}
    for stage in range(4):
        runs[f"zero{stage}"] = run_deepspeed(data, device, ds_config(stage, MICRO_BATCH, 1),
                                             save_to=checkpoints if stage == 3 else None)
    runs["gas1_mb8"] = runs["zero1"]
    runs["gas2_mb4"] = run_deepspeed(data, device, ds_config(1, MICRO_BATCH // 2, 2))

    scales: list[float] = []
    snapshots: list[list[list[float]]] = []

    def watch(step: int, engine: Any) -> None:
        scales.append(float(engine.optimizer.cur_scale))
        snapshots.append(host_parameters(engine.module))

    runs["fp16_overflow"] = run_deepspeed(data, device, ds_config(1, MICRO_BATCH, 1, fp16=True), on_step=watch)
    runs["fp16_overflow"].update(scales=scales, parameters_after_each_step=snapshots)

    runs["dropout_checkpointed"] = run_checkpointing(data, device, checkpointing=True)
    runs["dropout_not_checkpointed"] = run_checkpointing(data, device, checkpointing=False)
    runs["dropout_checkpointed_other_seed"] = run_checkpointing(data, device, checkpointing=True, seed=300)

    offload = ds_config(2, MICRO_BATCH, 1)
    offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    offload["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": ADAMW["lr"],
                                                                "warmup_num_steps": 2, "total_num_steps": STEPS}}
    bf16 = ds_config(1, MICRO_BATCH, 1)
    bf16["bf16"] = {"enabled": True}
    resumes = {
        "zero2_offload_warmup_decay": run_resume(data, device, offload, checkpoints, "offload", control=True),
        "zero1_bf16": run_resume(data, device, bf16, checkpoints, "bf16"),
        "zero1_fp16_after_an_overflow": run_resume(data, device, ds_config(1, MICRO_BATCH, 1, fp16=True), checkpoints,
                                                   "fp16", overflow_step=1),
    }
    runs["portable"] = run_portable(data, device, checkpoints)
    nvme = Path(checkpoints).parent / f"nvme-rank{rank}"  # each rank its own directory, as on separate disks
    runs["infinity"] = compare_infinity({offload or "device": run_infinity(data, device, offload, nvme)
                                         for offload in (None, "cpu", "nvme")})
    analysis = Path(checkpoints).parent / "curriculum-analysis"
    runs["curriculum_sampling"] = {"analyzed": analyze(analysis)} | {
        state: run_curriculum_sampling(Path(checkpoints).parent, device, ds_config(1, MICRO_BATCH, 1), make_model,
                                       curriculum=state == "on", analysis=analysis) for state in ("on", "off")}
    runs["moe"] = run_moe(device)
    runs["autotp"] = run_autotp(device)
    runs["one_pass_offload"] = run_one_pass_offload(data, device)  # reverts the one-pass set
    # last: a pipeline engine leaves its grid in deepspeed.utils.groups, where later engines would find it
    runs["pipeline"] = run_pipeline(device)
    if rank == 0:
        with open(args.report, "w") as f:
            json.dump({"world": world, "device": str(device), "overflow_step": OVERFLOW_STEP,
                       "initial_scale": 2.0 ** INITIAL_SCALE_POWER, "save_after": SAVE_AFTER, "runs": runs,
                       "resumes": resumes}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
