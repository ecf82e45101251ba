"""Train a small GPT with DeepSpeed: an ordinary DeepSpeed script plus devshim's one import line.

Run it with either launcher, e.g.
    deepspeed --num_gpus 2 examples/train_gpt.py --zero-stage 2
    torchrun --nproc-per-node 2 examples/train_gpt.py --zero-stage 3 --bf16
    DEVSHIM_AUTO=1 DEVSHIM_CPU_DEVICE_COUNT=2 deepspeed examples/train_gpt.py  # the launcher sizes the job
Generated data (a noisy affine token sequence a model can learn), no downloads. Rank 0 prints the loss
per step and tokens/s, and writes a JSON report with ``--report``.

devshim's line comes first here. Scripts that already ``import deepspeed`` before it work too: set
DEVSHIM_EXAMPLE_IMPORT_DEEPSPEED_FIRST=1 to run this one in that order. DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM=1
leaves devshim's line out, so `make bench` compares the same script on DeepSpeed's own CPU accelerator.
"""

# ruff: noqa: E402  (the import order below is the point: devshim's line precedes DeepSpeed's)
import os
import sys

if os.environ.get("DEVSHIM_EXAMPLE_IMPORT_DEEPSPEED_FIRST", "").strip() not in ("", "0"):
    import deepspeed  # DeepSpeed auto-detects its own accelerator and binds its op builders now

DEEPSPEED_IMPORTED_BEFORE_DEVSHIM = "deepspeed" in sys.modules

if os.environ.get("DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM", "").strip() in ("", "0"):
    import devshim_core.auto  # devshim's one line

    SESSION = devshim_core.auto.session
else:  # the same script as its users had it before devshim, for `make bench`'s end-to-end comparison
    SESSION = None

import argparse
import json
import math
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--offload", action="store_true", help="ZeRO-Offload the optimizer to the host")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--pipeline-stages", type=int, default=0, help="train with DeepSpeed's pipeline engine")
    p.add_argument("--save-dir", help="save a checkpoint here after --save-at steps")
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--load-dir", help="resume from the latest checkpoint here")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--report", help="rank 0 writes a JSON report here")
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    return p.parse_args()


# -- model ---------------------------------------------------------------------------------------


class Block(nn.Module):
    forward_calls = 0  # in this process; activation checkpointing runs each forward twice (once to recompute)

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.forward_calls += 1
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class Head(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed = Embed(args.vocab, args.hidden, args.seq)
        self.blocks = nn.ModuleList(Block(args.hidden, args.heads) for _ in range(args.layers))
        self.head = Head(args.vocab, args.hidden)
        self.checkpointing = args.activation_checkpointing

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.checkpointing else block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def pipeline_model(args: argparse.Namespace) -> deepspeed.pipe.PipelineModule:
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(Embed, args.vocab, args.hidden, args.seq),
              *[LayerSpec(Block, args.hidden, args.heads) for _ in range(args.layers)],
              LayerSpec(Head, args.vocab, args.hidden)]
    return PipelineModule(layers=layers, num_stages=args.pipeline_stages, loss_fn=lm_loss,
                          partition_method="uniform",
                          activation_checkpoint_interval=1 if args.activation_checkpointing else 0)


# -- data ----------------------------------------------------------------------------------------


def batches(args: argparse.Namespace, rank: int, device: torch.device, start_step: int):
    """Sequences t[i+1] = (5 t[i] + 3) mod V with 10 % random tokens: learnable, never memorised."""
    step = start_step
    while True:
        g = torch.Generator().manual_seed(args.seed * 1000003 + step * 101 + rank)
        n = args.micro_batch
        seq = torch.empty(n, args.seq + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(args.vocab, (n,), generator=g)
        for i in range(args.seq):
            seq[:, i + 1] = (5 * seq[:, i] + 3) % args.vocab
        noise = torch.rand(n, args.seq + 1, generator=g) < 0.1
        seq[noise] = torch.randint(args.vocab, (int(noise.sum()),), generator=g)
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)
        step += 1


# -- training ------------------------------------------------------------------------------------


def ds_config(args: argparse.Namespace, world: int) -> dict:
    zero: dict = {"stage": args.zero_stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.offload:
        config["zero_force_ds_cpu_optimizer"] = True
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    if args.pipeline_stages:
        config["train_batch_size"] = args.micro_batch * args.grad_accum * (world // args.pipeline_stages)
    return config


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    accel = get_accelerator()
    accel.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = accel.device(accel.current_device())
    accel.manual_seed_all(args.seed)
    torch.manual_seed(args.seed)
    if args.activation_checkpointing and not args.pipeline_stages:
        deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)

    model = pipeline_model(args) if args.pipeline_stages else GPT(args)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config(args, world))
    start, client = 0, {}
    if args.load_dir:
        load_path, client = engine.load_checkpoint(args.load_dir)
        if load_path is None:
            raise SystemExit(f"no checkpoint to resume from in {args.load_dir}")
        start = client["step"]
    dp_rank = engine.mpu.get_data_parallel_rank() if args.pipeline_stages else rank
    data = batches(args, dp_rank, device, start * args.grad_accum)

    if rank == 0:
        chosen = f"plugin {SESSION.selection.plugin.name} ({SESSION.selection.reason})" if SESSION else "not imported"
        print(f"devshim: {chosen}; accelerator {type(accel).__name__}, device {device}, "
              f"backend {accel.communication_backend_name()}")
    grad_devices: set[str] = set()
    for param in engine.module.parameters():  # where autograd produced each gradient, before ZeRO moves it
        if param.requires_grad:
            param.register_hook(lambda grad: grad_devices.add(str(grad.device)))
    losses, times = [], []
    Block.forward_calls = 0
    tokens_per_step = args.micro_batch * args.seq * args.grad_accum * engine.dp_world_size
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        if args.pipeline_stages:
            loss = engine.train_batch(data_iter=data)
        else:
            total = 0.0
            for _ in range(args.grad_accum):
                tokens, labels = next(data)
                loss = engine(tokens, labels)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach()) / args.grad_accum
            loss = torch.tensor(total, device=device)
        # collectives take device tensors (HCCL and SCCL refuse host ones): reduce first, then read
        loss = loss.detach().float().reshape(1)
        if not args.pipeline_stages:  # the pipeline engine already reports the data-parallel mean
            dist.all_reduce(loss)
            loss /= world
        loss = loss.cpu()
        elapsed = time.perf_counter() - t0
        losses.append(float(loss))
        times.append(elapsed)
        if len(times) == 1:
            first_step_done_at = time.time()  # wall clock, so a launcher can time start-up to the first step
        if rank == 0:
            print(f"step {step + 1:4d}  loss {float(loss):.4f}  {tokens_per_step / elapsed:9.0f} tokens/s", flush=True)
        if args.save_dir and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, client_state={"step": step + 1, "losses": list(losses)})

    steady = times[len(times) // 2:] or times
    blocks = sum(isinstance(m, Block) for m in engine.module.modules())  # on this rank's pipeline stage
    basic = getattr(optimizer, "optimizer", optimizer)  # what a ZeRO/bf16 wrapper steps with
    state_devices = sorted({str(value.device) for state in getattr(basic, "state", {}).values()
                            for value in state.values() if torch.is_tensor(value) and value.dim() > 0})
    # ZeRO-Offload's fp32 master partitions live in host memory, page-locked when the device can pin it
    offloaded = getattr(optimizer, "single_partition_of_fp32_groups", None) if args.offload else None
    summary = {
        "offload_partitions_pinned": [bool(t.is_pinned()) for t in offloaded] if offloaded else None,
        "rank_count": world,
        "dist_backend": dist.get_backend(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "current_device": accel.current_device(),
        "param_devices": sorted({str(p.device) for p in engine.module.parameters()}),
        "grad_devices": sorted(grad_devices),
        "optimizer_state_devices": state_devices,
        "accelerator": type(accel).__name__,
        "accelerator_module": type(accel).__module__,
        "device": str(device),
        "backend": accel.communication_backend_name(),
        "plugin": SESSION.selection.plugin.name if SESSION else None,
        "device_count": accel.device_count(),
        "visible_devices": {name: os.environ.get(name) for name in accel.visible_devices_envs()},
        "deepspeed_imported_before_devshim": DEEPSPEED_IMPORTED_BEFORE_DEVSHIM,
        "deepspeed_integration": SESSION.integrations.get("deepspeed") if SESSION else None,
        "engine": type(engine).__name__,
        "pipeline_stages": engine.num_stages if args.pipeline_stages else 0,
        "pipeline_stage": engine.stage_id if args.pipeline_stages else 0,
        "data_parallel_size": engine.dp_world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "bf16": engine.bfloat16_enabled(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "optimizer_steps": engine.global_steps,  # restored by load_checkpoint, so it counts from step 0
        "micro_steps": engine.micro_steps,
        "optimizer": type(optimizer).__name__,
        "basic_optimizer": type(basic).__name__,
        "engine_optimizer_op": type(getattr(basic, "ds_opt_adam", None)).__name__,
        "fused_op": type(getattr(getattr(basic, "multi_tensor_adam", None), "__self__", None)).__name__,
        "param_dtype": str(next(engine.module.parameters()).dtype),
        "start_step": start,
        "client_state": {key: value for key, value in client.items() if key in ("step", "losses")},
        "blocks": blocks,
        "forwards_per_block_per_micro_batch": Block.forward_calls / max(1, len(losses) * args.grad_accum * blocks),
        "losses": losses,
        "tokens_per_s": tokens_per_step / (sum(steady) / len(steady)) if steady else math.nan,
        "step_seconds": times,
        "first_step_done_at": first_step_done_at if times else None,
    }
    # every rank's view of the per-process facts, so a report proves them for the whole job, not rank 0 alone
    per_rank_fields = ("dist_backend", "local_rank", "current_device", "device", "param_devices", "grad_devices",
                       "optimizer_state_devices", "offload_partitions_pinned", "accelerator", "plugin",
                       "device_count", "visible_devices", "deepspeed_imported_before_devshim",
                       "deepspeed_integration", "engine", "pipeline_stage", "optimizer", "basic_optimizer",
                       "engine_optimizer_op", "fused_op", "param_dtype", "start_step", "blocks",
                       "forwards_per_block_per_micro_batch")
    ranks: list = [None] * world
    dist.all_gather_object(ranks, {"rank": rank, **{key: summary[key] for key in per_rank_fields}})
    summary["ranks"] = ranks
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; steady state {summary['tokens_per_s']:.0f} tokens/s")
        if args.report:
            with open(args.report, "w") as f:
                json.dump(summary, f, indent=2)
    dist.barrier()
    # gloo's worker threads must be joined before interpreter shutdown; left to static destructors they can
    # abort the process ("terminate called without an active exception") after a successful run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
