"""A DeepSpeed job that survives a killed rank: what ``test_restart.py`` runs under ``torchrun --max-restarts 1``.

An ordinary fault-tolerant training script plus devshim's one line: ZeRO-2, fp32, a tiny language model, the
data of step k generated from (seed, k, rank) alone, a DeepSpeed checkpoint every ``--save-every`` steps with
client state {step, losses so far}, and on start ``load_checkpoint`` of whatever ``latest`` names, if anything.
torchrun restarts every worker after a failure and tells each attempt its number in TORCHELASTIC_RESTART_COUNT.

On the first attempt only (TORCHELASTIC_RESTART_COUNT == "0") the job can kill one of its own ranks with
SIGKILL, at a deterministic point:

- ``--kill-after-step N``: rank ``--kill-rank`` dies right after step N (its loss is reported, the step's
  checkpoint, if any, is not started);
- ``--kill-in-save N``: rank ``--kill-rank`` dies while the checkpoint of step N is being written: DeepSpeed has
  written the model states file, and of the rank's ZeRO optimizer states file only the first half is on disk.

Every rank appends what it does (start, each step, each finished save, the kill) to ``--events`` as JSON lines;
rank 0 writes a JSON report with ``--report`` when the job completes, including what the checkpoint directory
held when the attempt started (``latest`` and every tag's files, their sizes and whether ``torch.load`` reads them).

Usage: torchrun --max-restarts 1 --nproc-per-node 2 restart_job.py --save-dir DIR --events FILE --report OUT.json
"""

import devshim_core.auto  # noqa: I001 - first: the only line a DeepSpeed script adds

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, SEQ, HIDDEN, MICRO_BATCH = 64, 16, 32, 4
SEED = 1234
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--save-dir", type=Path, required=True)
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-after-step", type=int, default=0)
    p.add_argument("--kill-in-save", type=int, default=0)
    p.add_argument("--report")
    return p.parse_args()


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(SEQ, hidden)
        self.mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        x = x + self.mlp(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def zero2_config(world: int) -> dict[str, Any]:
    """ZeRO-2, fp32, AdamW with clipping, one micro-batch of ``MICRO_BATCH`` per rank and step."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }


def batch(step: int, rank: int, device: torch.device, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s data on ``rank``: t[i+1] = (5 t[i] + 3) mod V with 10 % random tokens, from the step alone."""
    g = torch.Generator().manual_seed(SEED * 1000003 + step * 101 + rank)
    seq = torch.empty(MICRO_BATCH, SEQ + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab, (MICRO_BATCH,), generator=g)
    for i in range(SEQ):
        seq[:, i + 1] = (5 * seq[:, i] + 3) % vocab
    noise = torch.rand(MICRO_BATCH, SEQ + 1, generator=g) < 0.1
    seq[noise] = torch.randint(vocab, (int(noise.sum()),), generator=g)
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def log_event(path: Path, rank: int, event: str, **fields: Any) -> None:
    with open(path, "a") as f:  # one short line per write: the ranks' appends do not interleave
        f.write(json.dumps({"attempt": ATTEMPT, "rank": rank, "pid": os.getpid(), "event": event, **fields}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def inventory(save_dir: Path) -> dict[str, Any]:
    """What the checkpoint directory holds: the tag ``latest`` names, and each tag's files."""
    latest = save_dir / "latest"
    tags: dict[str, dict[str, Any]] = {}
    for tag_dir in sorted(p for p in save_dir.glob("global_step*") if p.is_dir()):
        files = {}
        for file in sorted(tag_dir.iterdir()):
            try:
                torch.load(file, map_location="cpu", weights_only=False)
                loads = True
            except Exception:
                loads = False
            files[file.name] = {"bytes": file.stat().st_size, "loads": loads}
        tags[tag_dir.name] = files
    return {"latest": latest.read_text().strip() if latest.exists() else None, "tags": tags}


def die_while_writing_optimizer_states(engine: deepspeed.DeepSpeedEngine, events: Path, rank: int) -> None:
    """The next ZeRO optimizer states file this rank saves keeps only its first half on disk (what dying in the
    middle of the write leaves), then the rank SIGKILLs itself, before save_checkpoint can go on.

    DeepSpeed's save_checkpoint writes the model states file (data-parallel rank 0), then each rank's optimizer
    states file, and only then has rank 0 write ``latest``; dying inside the second write leaves a tag directory
    that ``latest`` never names.
    """
    original = engine.checkpoint_engine.save

    def save(state_dict: dict, path: str) -> None:
        if not os.path.basename(path).startswith("zero_pp_rank_"):
            return original(state_dict, path)
        original(state_dict, path)  # DeepSpeed's own bytes, cut to their first half
        total = os.path.getsize(path)
        os.truncate(path, total // 2)
        tag_dir = Path(path).parent
        log_event(events, rank, "killed", while_writing=os.path.basename(path), bytes_written=total // 2,
                  bytes_total=total, tag=tag_dir.name,
                  tag_files={p.name: p.stat().st_size for p in sorted(tag_dir.iterdir())})
        os.kill(os.getpid(), signal.SIGKILL)
        return None

    engine.checkpoint_engine.save = save


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    accel = get_accelerator()
    accel.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = accel.device(accel.current_device())
    torch.manual_seed(SEED)
    accel.manual_seed_all(SEED)
    log_event(args.events, rank, "start")

    model = TinyLM()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=zero2_config(world))

    found = inventory(args.save_dir) if rank == 0 else None  # before load_checkpoint touches anything
    load_path, client = engine.load_checkpoint(str(args.save_dir))  # (None, None) when no `latest` exists
    resumed_tag = Path(load_path).parent.name if load_path is not None else None  # load_path: the model states
    start = client["step"] if load_path is not None else 0
    losses: list[float] = list(client["losses"]) if load_path is not None else []
    log_event(args.events, rank, "resumed" if load_path is not None else "fresh", step=start, tag=resumed_tag)

    for step in range(start, args.steps):
        tokens, labels = batch(step, rank, device)
        loss = engine(tokens, labels)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(float(mean.cpu()) / world)
        done = step + 1
        if rank == 0:
            log_event(args.events, rank, "step", step=done, loss=losses[-1])
        first_attempt_victim = ATTEMPT == 0 and rank == args.kill_rank
        if ATTEMPT == 0 and done == args.kill_after_step:
            dist.barrier()  # every rank has logged the step
            if first_attempt_victim:
                log_event(args.events, rank, "killed", step=done)
                os.kill(os.getpid(), signal.SIGKILL)
        if done % args.save_every == 0:
            if first_attempt_victim and done == args.kill_in_save:
                die_while_writing_optimizer_states(engine, args.events, rank)
            engine.save_checkpoint(str(args.save_dir), client_state={"step": done, "losses": list(losses)})
            if rank == 0:
                log_event(args.events, rank, "saved", step=done)

    starts: list = [None] * world
    dist.all_gather_object(starts, start)
    if rank == 0 and args.report:
        report = {
            "attempt": ATTEMPT,
            "max_restarts": os.environ.get("TORCHELASTIC_MAX_RESTARTS"),
            "plugin": devshim_core.auto.session.selection.plugin.name,
            "accelerator": type(accel).__name__,
            "backend": dist.get_backend(),
            "zero_stage": engine.zero_optimization_stage(),
            "checkpoint_at_start": found,
            "resumed_from": resumed_tag,
            "start_steps": starts,
            "checkpoint_losses": list(client["losses"]) if load_path is not None else [],
            "losses": losses,
            "optimizer_steps": engine.global_steps,
        }
        Path(args.report).write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
