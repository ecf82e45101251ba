"""One contender of ``bench/file_io.py``: serves timed writes and reads of one buffer, one command per line.

``--contender deepspeed`` never imports devshim: DeepSpeed's own ``async_io`` op, JIT-built against libaio by
its CPU op builder (``DS_ACCELERATOR=cpu``; the build lands in ``$TORCH_EXTENSIONS_DIR`` and is reused).
``--contender devshim`` imports ``devshim_core.auto`` (cpu_reference) and checks that DeepSpeed's builder now
loads devshim's op. Both then allocate the buffer with the op's ``new_cpu_locked_tensor`` and make one handle
with the same configuration. Protocol, on stdin/stdout: ``write PATH`` or ``read PATH`` -> the seconds the
synchronous transfer took (``sync_pwrite``/``sync_pread``); ``quit`` ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contender", choices=("deepspeed", "devshim"), required=True)
    parser.add_argument("--megabytes", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--queue-depth", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True, help="intra_op_parallelism")
    args = parser.parse_args()
    if args.contender == "devshim":
        import devshim_core.auto  # noqa: F401
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    start = time.perf_counter()
    op = AsyncIOBuilder().load(verbose=False)
    load_seconds = time.perf_counter() - start
    module = type(op).__module__ if args.contender == "devshim" else getattr(op, "__name__", type(op).__name__)
    if args.contender == "devshim" and module != "devshim_core.integrations.deepspeed.aio":
        raise SystemExit(f"devshim is active but DeepSpeed loaded {module}")
    handle = op.aio_handle(args.block_size, args.queue_depth, False, True, args.threads)
    buffer = handle.new_cpu_locked_tensor(args.megabytes << 20, torch.empty(0, dtype=torch.uint8))
    buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    print(json.dumps({"ready": True, "op": module, "load_seconds": load_seconds}), flush=True)
    for line in sys.stdin:
        command, _, path = line.strip().partition(" ")
        if command == "quit":
            break
        start = time.perf_counter()
        count = handle.sync_pwrite(buffer, path) if command == "write" else handle.sync_pread(buffer, path)
        seconds = time.perf_counter() - start
        if count != 1:
            raise SystemExit(f"{command} {path}: the op returned {count}")
        print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
