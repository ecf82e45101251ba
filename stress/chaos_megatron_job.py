"""The chaos loop's megatron-core job: 2 ranks, tensor parallel 2, a checkpoint every ``--save-every`` steps, resume.

The model, data and step are ``examples/megatron_gpt.py``'s (imported from it, CUDA-written, run by devshim's
redirect), each tensor-parallel all-reduce of activations ([128 tokens, 8 sequences, 256] fp32) moving 1 MiB per
rank through devshim's shared-memory collectives whenever ``/dev/shm`` has room. The data of step k
comes from k alone. Checkpoints are the example's ``megatron.core.dist_checkpointing`` saves of model and optimizer,
laid out as Megatron-LM lays them out: ``iter_0000003/`` and a tracker file
``latest_checkpointed_iteration.txt`` that rank 0 writes once every rank has finished the save. On start the job
loads the iteration the tracker names, if any.

It prints the lines the harness (``stress/chaos.py``) reads (:mod:`stress.chaos_protocol`).

    torchrun --nproc-per-node 2 stress/chaos_megatron_job.py --steps 9 --save-every 3 --save-dir DIR
"""

import devshim_core.auto  # noqa: F401, I001 - first: detect, select a plugin, patch

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script by torchrun: find stress/
from stress import chaos_protocol as say  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name for it


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megatron_gpt", ROOT / "examples" / "megatron_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    args = say.job_arguments(__doc__)

    gpt = example()
    o = gpt.Options(tp=2, hidden=256, heads=4, layers=2, seq=128, vocab=128, micro_batch=8, global_batch=8)
    gpt.init_distributed()
    rank = dist.get_rank()
    say.started(rank)
    gpt.init_parallel(o)
    config = gpt.transformer_config(o)
    chunks = gpt.wrap(o, config, gpt.build_model(o, config))
    optimizer = gpt.optimizer_for(o, chunks)

    tracker = args.save_dir / TRACKER
    start = int(tracker.read_text().strip()) if tracker.exists() else 0
    if start:
        tag = f"iter_{start:07d}"
        gpt.load(str(args.save_dir / tag), chunks, optimizer)
        if rank == 0:
            say.resumed(tag, start)
    elif rank == 0:
        say.fresh()

    for step in range(start, args.steps):
        loss, _ = gpt.train_step(o, chunks, optimizer, step)
        done = step + 1
        if rank == 0:
            say.step(done, loss)
        if done % args.save_every == 0 or done == args.steps:
            tag = f"iter_{done:07d}"
            gpt.save(str(args.save_dir / tag), chunks, optimizer)
            dist.barrier()  # every rank's shards are written before the tracker names them
            if rank == 0:
                tracker.write_text(f"{done}\n")
                say.saved(tag)

    say.finished(rank, args.steps)
    dist.barrier()
    gpt.parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
