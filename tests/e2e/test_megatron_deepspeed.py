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

- Its ``megatron/model/fused_softmax.py`` imports ``scaled_masked_softmax_cuda`` and
  ``scaled_upper_triang_masked_softmax_cuda``, with no fallback, whenever masked-softmax fusion is on (its default)
  and the scores are fp16 or bf16. devshim provides them on the plugin's masked_softmax kernel; before, every fp16 or
  bf16 run with default flags died with ModuleNotFoundError (``--no-masked-softmax-fusion`` was the workaround).

=============================================  =====  ==============================================================
job                                            ranks  proves
=============================================  =====  ==============================================================
ZeRO-1, tensor parallel 2, fp32/fp16/bf16      2      the run exits 0, logs a finite loss per iteration that falls;
                                                      fp16/bf16 with the fork's default flags (fused softmax on)
ZeRO-1, pipeline parallel 2, fp32/fp16/bf16    2      the same through DeepSpeed's pipeline engine (GPTModelPipe)
TP 2 against TP 1 (dropout 0), fp32 and bf16,  2 + 1  equal losses (``TP_LOSS_RTOL``) on the host CPU and the
  on cpu and the emulated tpu                         emulated Sophgo ``tpu`` (the plugin's backend and device named
                                                      by the job)
=============================================  =====  ==============================================================
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from .launch import venv_bin
from .platforms import CPU, SOPHGO, Platform, build_emulator
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
# TP 2 splits the same matmuls in two and sums over gloo/sccl: fp32 agrees to rounding; bf16 rounds the two halves'
# partial sums separately (seen 2026-11-27: fp32 equal on cpu, 2.3e-7 on tpu; bf16 3.4e-5 on cpu, 4.1e-5 on tpu)
TP_LOSS_RTOL = {"fp32": 1e-5, "bf16": 1e-3}
PRECISION_FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}
# As in test_megatron_lm.py: 127 + 1 tokens pad to 128 for TP 1 and TP 2 alike only with a divisor of 64 (the default
# 128 x TP pads TP 2 to 256, a different model); the full weights are drawn once on the CPU and split
DETERMINISTIC = ["--hidden-dropout", "0", "--attention-dropout", "0", "--make-vocab-size-divisible-by", "64",
                 "--use-cpu-initialization"]
# Documents are shifted ranges (arange(n) + k) % VOCAB_SIZE: very learnable. Cross-entropy starts near
# ln(padded vocab); a fall of 0.3 nats within 8 iterations is far from noise yet proves the optimizer stepped.
LOSS_DROP = 0.3

# 8 heads: with micro-batch 2, b * heads per rank is 16 (TP 1) or 8 (TP 2), a multiple of the CUDA kernel's 8 rows per
# block at 64 keys, so the fork's is_kernel_available takes the fused softmax (with 4 heads, TP 2 would not)
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", str(SEQ_LENGTH),
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


def deepspeed_config(path: Path, precision: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "steps_per_print": 1,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
        "bf16": {"enabled": precision == "bf16"},
        "wall_clock_breakdown": False,
    }))
    return path


def pretrain_gpt(checkout_path: Path, data: Path, parallel: list[str], workdir: Path, precision: str = "fp32",
                 platform: Platform = CPU, nproc: int = 2, extra: tuple[str, ...] = ()):
    config = deepspeed_config(workdir / "ds_config.json", precision)
    args = [*MODEL, *TRAINING, "--data-path", str(data), *parallel, *PRECISION_FLAGS[precision], *extra,
            "--deepspeed", "--deepspeed_config", str(config), "--zero-stage", "1"]
    env = platform.job_env({**platform.two_devices_env, "DEVSHIM_PLUGIN": platform.plugin,
                            **job_pythonpath(checkout_path)})
    return run_script(checkout_path / "pretrain_gpt.py", args, workdir, nproc=nproc, env=env)


TP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"]
TP1 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
PP2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("parallel", [pytest.param(TP2, id="tp2"), pytest.param(PP2, id="pp2")])
def test_zero1_trains_with_the_forks_default_flags(megatron_deepspeed: Path, dataset: Path, parallel: list[str],
                                                   precision: str, tmp_path: Path) -> None:
    job = pretrain_gpt(megatron_deepspeed, dataset, parallel, tmp_path, precision)
    assert_succeeded(job)
    assert_losses_fell(lm_losses(job), ITERATIONS, LOSS_DROP, job)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("platform", [CPU, SOPHGO], ids=["cpu", "tpu"])
def test_tensor_parallel_2_matches_one_rank(megatron_deepspeed: Path, dataset: Path, platform: Platform,
                                           precision: str, tmp_path: Path) -> None:
    if platform.emulated:
        build_emulator()
    single = pretrain_gpt(megatron_deepspeed, dataset, TP1, tmp_path / "tp1", precision, platform, nproc=1,
                          extra=tuple(DETERMINISTIC))
    split = pretrain_gpt(megatron_deepspeed, dataset, TP2, tmp_path / "tp2", precision, platform,
                         extra=tuple(DETERMINISTIC))
    for job in (single, split):
        assert_succeeded(job)
        ran_on = f"FIRST_LINE plugin={platform.plugin} device_type={platform.device_type} backend={platform.backend}"
        assert ran_on in job.stdout, job.tail()
    one, two = lm_losses(single), lm_losses(split)
    assert len(one) == len(two) == ITERATIONS, (one, two)
    worst = max(abs(a - b) / abs(b) for a, b in zip(two, one, strict=True))
    print(f"TP2-vs-TP1 {platform.id} {precision}: worst {worst:.2e}; TP 1 {one}; TP 2 {two}")  # the docs' figures
    assert worst <= TP_LOSS_RTOL[precision], f"TP 2 {two} against TP 1 {one}: {worst:.2e}\n{split.tail()}"
