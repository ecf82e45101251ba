"""One rank of one contender of ``bench/offload_step.py``: a ZeRO-2 bf16 engine with the optimizer offloaded.

The contenders (``--contender``):

- ``devshim``: imports ``devshim_core.auto`` (cpu_reference): every devshim path on, the one-pass host Adam and
  the shared-memory collectives among them;
- ``devshim-collectives-off``: the same, started by the bench with ``DEVSHIM_DISABLE=torch.distributed-shared-memory``
  (devshim's own switch, the patch set's name): gloo's TCP transport for every collective, as on a vendor device;
- ``deepspeed``: never imports devshim and runs DeepSpeed's own CPU accelerator as it is (``DS_ACCELERATOR=cpu``,
  its JIT-built ``cpu_adam``; its ``TorchBackend`` also builds and initialises its shared-memory op
  ``deepspeed_shm_comm``, which only its ``inference_all_reduce`` calls: a ZeRO-2 step makes none, and
  ``--profile`` counts them to show it).

Rank 0 reads commands on stdin and passes them to the other ranks: ``run K`` trains K steps and prints, as one JSON
line after ``BENCH``, each step's wall time, the time of its ``engine.step()`` (the optimizer step: host Adam, the
copies to the device weights, the all-gather), and its loss; ``quit`` ends. The engine is built and warmed up
before the first line (``ready``), which also says which collectives each contender really ran on: whether
devshim's ``torch.distributed-shared-memory`` set is applied (from ``devshim_core.active_session()``), why it was
left out, and how many process groups mapped a shared segment; whether DeepSpeed built its shared-memory op.

``--profile`` adds, per step, rank 0's time in the forward, the backward and ``engine.step()``, and within them:
the host Adam (the base optimizer's ``step``: DeepSpeed's ``cpu_adam``, or devshim's, which also writes the bf16
copy DeepSpeed converts afterwards) and the collectives (every ``deepspeed.comm`` collective, timed at its backend
``cdb``: the gradients' reductions in the backward, the norm's all-reduce and the weights' all-gather in the step).
The wrappers are plain wall-clock timers, the same for every contender; the ``ready`` line also counts each
collective's calls in the warm-up steps.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
from typing import Any

SHARED_MEMORY_SET = "torch.distributed-shared-memory"
# the deepspeed.comm backend's collectives (deepspeed/comm/comm.py calls each as ``cdb.<name>``)
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce", "reduce", "reduce_scatter_tensor",
               "reduce_scatter", "all_gather_into_tensor", "all_gather", "all_gather_coalesced", "broadcast")


class Profile:
    """Wall-clock time per bucket, the bucket of a collective being the phase it ran in."""

    def __init__(self) -> None:
        self.phase = "other"
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: str, bucket: str | None) -> None:
        """Time ``owner.name`` into ``bucket`` (``None``: a collective, timed into ``"<phase> collectives"`` and
        counted)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[bucket or f"{self.phase} collectives"] += time.perf_counter() - start
                if bucket is None:
                    self.calls[name] += 1

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        taken = dict(self.seconds)
        self.seconds.clear()
        return taken


def shared_memory_state(contender: str) -> dict[str, Any]:
    """Whether devshim's shared-memory collectives are applied in this process, and used."""
    if contender == "deepspeed":
        return {"devshim_active": "devshim_core" in sys.modules}
    import devshim_core
    from devshim_core.integrations.torch_distributed.shm_segment import SEGMENTS

    session = devshim_core.active_session()
    assert session is not None
    disabled = [row for row in session.disabled if row["set"] == SHARED_MEMORY_SET and row["patch"] is None]
    return {"patch_applied": any(row["set"] == SHARED_MEMORY_SET for row in session.patches),
            "disabled": disabled[0]["reason"] if disabled else None,
            "segments_mapped": SEGMENTS.mapped(),
            "integration": session.integrations.get(SHARED_MEMORY_SET)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contender", choices=("deepspeed", "devshim", "devshim-collectives-off"), required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.contender == "deepspeed":
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        import devshim_core.auto  # noqa: F401
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 1 << 30,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inputs = torch.randn(2, args.width, generator=torch.Generator().manual_seed(rank)).to(engine.device,
                                                                                        torch.bfloat16)
    profile = Profile() if args.profile else None
    if profile is not None:
        profile.wrap(engine.optimizer.optimizer, "step", "host Adam")
        for name in COLLECTIVES:
            if hasattr(ds_comm.cdb, name):
                profile.wrap(ds_comm.cdb, name, None)

    def train(steps: int) -> dict[str, list[Any]]:
        walls, optimizer_steps, losses, phases = [], [], [], []
        for _ in range(steps):
            dist.barrier()
            if profile is not None:
                profile.take()
                profile.phase = "forward"
            start = time.perf_counter()
            loss = engine(inputs).float().pow(2).mean()
            after_forward = time.perf_counter()
            if profile is not None:
                profile.phase = "backward"
            engine.backward(loss)
            before_step = time.perf_counter()
            if profile is not None:
                profile.phase = "step"
            engine.step()
            end = time.perf_counter()
            walls.append(end - start)
            optimizer_steps.append(end - before_step)
            losses.append(loss.item())
            if profile is not None:
                profile.phase = "other"
                phases.append({"forward": after_forward - start, "backward": before_step - after_forward,
                               "step": end - before_step, **profile.take()})
        measured: dict[str, list[Any]] = {"seconds": walls, "optimizer_step_seconds": optimizer_steps,
                                          "losses": losses}
        if profile is not None:
            measured["phases"] = phases
        return measured

    train(args.warmup)
    op = getattr(engine.optimizer.optimizer, "ds_opt_adam", None)
    one_pass = getattr(engine.optimizer, "devshim_one_pass", None)
    if rank == 0:
        print("BENCH", json.dumps({
            "ready": True, "parameters": sum(p.numel() for p in model.parameters()),
            "cpu_adam_op": type(op).__module__ if args.contender != "deepspeed" else str(op),
            "one_pass_copies": None if one_pass is None else one_pass.written,
            "backend": dist.get_backend(),
            "shared_memory": shared_memory_state(args.contender),
            "deepspeed_shm_comm_op": getattr(ds_comm.cdb, "shm_comm_op", None) is not None,
            "warmup_collective_calls": None if profile is None else dict(profile.calls)}), flush=True)
    while True:
        command = [sys.stdin.readline().strip() if rank == 0 else ""]
        dist.broadcast_object_list(command, src=0)
        verb, _, count = command[0].partition(" ")
        if verb != "run":
            break
        measured = train(int(count))
        if rank == 0:
            print("BENCH", json.dumps(measured), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
