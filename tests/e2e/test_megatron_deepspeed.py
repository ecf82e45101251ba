"""End to end: Megatron-DeepSpeed's ``pretrain_gpt.py --deepspeed``, unmodified but for devshim's import line.

Needs ``MEGATRON_DEEPSPEED_PATH``: a checkout of deepspeedai/Megatron-DeepSpeed at commit ``PINNED_COMMIT``. Its
``megatron`` is a regular package (a fork of an older Megatron, with its own ``megatron/core``), so it wins over
the installed megatron-core wherever the checkout sits on the path.

- The import line is added by ``tests/e2e/first_line.py``; the checkout is not edited.
- It has no mock data: each test writes a tiny ``.bin``/``.idx`` dataset with the checkout's own
  ``megatron.data.indexed_dataset`` builder (run in a helper process) and trains on it with ``NullTokenizer``.
- Its ``megatron/training.py`` imports its vision code (``torchvision``, ``PIL``) and its tokenizer module imports
  ``transformers``, all at module level and all unused by GPT: ``tests/e2e/standins`` provides import-only
  stand-ins, on ``PYTHONPATH`` for these jobs only.
- It imports ``deepspeed.compression.compress`` (``init_compression``, ``redundancy_clean``), which DeepSpeed
  0.19.8 removed; devshim provides that module, this test does not.
- Its ``megatron/__init__.py`` imports its ``megatron.core.tensor_parallel``, whose ``layers.py`` binds
  ``fused_weight_gradient_mlp_cuda`` at import time, and ``--gradient-accumulation-fusion`` is on by default:
  devshim must provide that module before anything imports ``megatron`` (a ``find_spec("megatron.core")`` on
  the fork imports the whole package). Otherwise the model build fails with "ColumnParallelLinear was called
  with gradient_accumulation_fusion set to True but ... fused_weight_gradient_mlp_cuda module is not found".
  The fork's backward then ignores the flag (its fused call is commented out): grads are plain matmuls.

=================================  =====  ==========================================================
job                                ranks  proves
=================================  =====  ==========================================================
ZeRO-1, tensor parallel 2          2      the run exits 0, logs a finite loss per iteration that falls
ZeRO-1, pipeline parallel 2        2      the same through DeepSpeed's pipeline engine (GPTModelPipe)
=================================  =====  ==========================================================
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from .launch import venv_bin
from .third_party import (
    STANDINS,
    assert_losses_fell,
    assert_succeeded,
    checkout,
    lm_losses,
    python_path,
    require_modules,
    run_python,
    run_script,
)

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the Megatron-DeepSpeed runs need deepspeed")

PINNED_COMMIT = "bcedecd1ff788d4d363f3365fd396053a08d65be"
ITERATIONS = 8
MICRO_BATCH, GLOBAL_BATCH = 2, 4
SEQ_LENGTH = 64
# NullTokenizer's vocabulary is --vocab-size + 1 (the end-of-document id); documents use ids 0..VOCAB_SIZE-1
VOCAB_SIZE = 127
# Documents are shifted ranges (arange(n) + k) % VOCAB_SIZE: very learnable. Cross-entropy starts near
# ln(padded vocab); a fall of 0.3 nats within 8 iterations is far from noise yet proves the optimizer stepped.
LOSS_DROP = 0.3

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ_LENGTH),
         "--max-position-embeddings", str(SEQ_LENGTH), "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(VOCAB_SIZE)]
TRAINING = ["--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(ITERATIONS), "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
            "--eval-iters", "1", "--eval-interval", str(10 * ITERATIONS), "--split", "100,0,0",
            "--num-workers", "0", "--seed", "1234"]


@pytest.fixture(scope="module")
def megatron_deepspeed() -> Path:
    path = checkout("MEGATRON_DEEPSPEED_PATH", f"deepspeedai/Megatron-DeepSpeed at commit {PINNED_COMMIT}",
                    "pretrain_gpt.py")
    require_modules("six", "regex", why="Megatron-DeepSpeed's megatron/tokenizer imports them at import time")
    return path


def job_pythonpath(checkout_path: Path) -> dict[str, str]:
    """The stand-ins and the checkout on ``PYTHONPATH``; the test virtualenv first on ``PATH``: rank 0's
    ``compile_helper`` runs ``make -C megatron/data``, whose Makefile calls ``python3 -m pybind11 --includes``,
    and that ``python3`` must be the one with pybind11 (the virtualenv's), not whatever the shell finds first."""
    search_path = os.pathsep.join([str(venv_bin("python").parent), os.environ.get("PATH", "")])
    return {"PYTHONPATH": python_path(STANDINS, checkout_path), "PATH": search_path}


@pytest.fixture(scope="module")
def dataset(megatron_deepspeed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT corpus written by the checkout's own ``MMapIndexedDatasetBuilder``; returns its path prefix."""
    directory = tmp_path_factory.mktemp("megatron-deepspeed-data")
    prefix = directory / "tiny_text_document"
    code = textwrap.dedent(f"""
        import numpy as np
        import torch
        from megatron.data import indexed_dataset

        prefix = {str(prefix)!r}
        builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(prefix), impl="mmap",
                                               vocab_size={VOCAB_SIZE + 1})
        rng = np.random.default_rng(0)
        for _ in range(256):
            length, start = int(rng.integers(32, 257)), int(rng.integers(0, {VOCAB_SIZE}))
            builder.add_item(torch.from_numpy((np.arange(length) + start) % {VOCAB_SIZE}))
            builder.end_document()
        builder.finalize(indexed_dataset.index_file_path(prefix))
        print(indexed_dataset.__file__)
    """)
    written_by = run_python(code, env=job_pythonpath(megatron_deepspeed), cwd=directory).strip().splitlines()[-1]
    assert Path(written_by).resolve().is_relative_to(megatron_deepspeed), written_by  # the checkout's own builder
    assert prefix.with_suffix(".bin").exists() and prefix.with_suffix(".idx").exists()
    return prefix


def deepspeed_config(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "steps_per_print": 1,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "wall_clock_breakdown": False,
    }))
    return path


def pretrain_gpt(checkout_path: Path, data: Path, parallel: list[str], workdir: Path):
    config = deepspeed_config(workdir / "ds_config.json")
    args = [*MODEL, *TRAINING, "--data-path", str(data), *parallel,
            "--deepspeed", "--deepspeed_config", str(config), "--zero-stage", "1"]
    return run_script(checkout_path / "pretrain_gpt.py", args, workdir, nproc=2, env=job_pythonpath(checkout_path))


@pytest.mark.parametrize("parallel", [
    pytest.param(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"], id="tp2"),
    pytest.param(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"], id="pp2"),
])
def test_zero1_trains(megatron_deepspeed: Path, dataset: Path, parallel: list[str], tmp_path: Path) -> None:
    job = pretrain_gpt(megatron_deepspeed, dataset, parallel, tmp_path)
    assert_succeeded(job)
    assert_losses_fell(lm_losses(job), ITERATIONS, LOSS_DROP, job)
