"""Spec: the features DeepSpeed 0.19.7/0.19.8 removed run through devshim on 2 ranks (``deepspeed_legacy_job.py``).

1-bit Adam, 0/1 Adam and 1-bit LAMB use the ``compressed`` backend, whose ``packbits`` op devshim serves (DeepSpeed
has one only for XPU); each run is checked bit for bit against the same run with a packer written on
``numpy.packbits``. Progressive layer drop and the legacy ``curriculum_learning`` config are checked against their
schedules' formulas. These need a DeepSpeed that still ships them: CI runs them on the oldest DeepSpeed devshim
supports (``make test-deepspeed-oldest``); on a newer one they skip, saying so.
"""

from __future__ import annotations

import importlib.util
import math
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from .launch import run_job
from .platforms import CPU

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")
if importlib.util.find_spec("deepspeed.runtime.fp16.onebit") is None:
    pytest.skip(f"DeepSpeed {metadata.version('deepspeed')} no longer ships 1-bit Adam, progressive layer drop and "
                "legacy curriculum learning: `make test-deepspeed-oldest` runs these on DeepSpeed 0.16.0",
                allow_module_level=True)

JOB = Path(__file__).resolve().parent / "deepspeed_legacy_job.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("legacy")
    job = run_job("torchrun", [], workdir, script=JOB,
                  env=CPU.job_env({**CPU.two_devices_env, "DEVSHIM_PLUGIN": CPU.plugin}))
    result = job.report()
    assert result["world"] == 2 and result["deepspeed"] == metadata.version("deepspeed")
    assert job.compiled_extensions() == [], job.compiled_extensions()
    return result


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_a_one_bit_optimizer_compresses_through_devshims_packbits_exactly_as_numpys_packbits_does(report, optimizer):
    runs = report["onebit"][optimizer]
    ours, numpy = runs["devshim"], runs["numpy"]
    assert ours["packer"] == "devshim_core.integrations.deepspeed.ops.PackbitsOp"
    assert ours["packs"] > 0 and ours["packs"] == numpy["packs"]  # the compressed phase really ran
    assert ours["losses"] == numpy["losses"]  # bit for bit, every step
    assert ours["spread_over_ranks"] == numpy["spread_over_ranks"]


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "OneBitLamb"])
def test_one_bit_adam_and_lamb_keep_every_rank_on_the_same_weights_through_the_compressed_phase(report, optimizer):
    # 0/1 Adam is left out: its local steps let the ranks drift apart between synchronisations, by design
    assert report["onebit"][optimizer]["devshim"]["spread_over_ranks"] == [0.0] * 8


def test_progressive_layer_drop_passes_the_scheduled_theta_to_forward(report):
    theta, gamma = report["pld_config"]["theta"], report["pld_config"]["gamma"]
    # the theta of step k is computed after step k-1: (1 - theta) * exp(-gamma * (k - 1)) + theta
    expected = [(1 - theta) * math.exp(-gamma * max(k - 1, 0)) + theta for k in range(len(report["pld"]))]
    assert len(report["pld"]) == 8
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(report["pld"], expected, strict=True)), report["pld"]


def test_legacy_curriculum_learning_passes_the_fixed_linear_sequence_length_to_forward(report):
    c = report["curriculum_config"]
    expected = []
    for step in range(1, len(report["curriculum_legacy"]) + 1):
        value = min(c["max_difficulty"], math.floor(step / c["total_curriculum_step"] *
                                                    (c["max_difficulty"] - c["min_difficulty"]) + c["min_difficulty"]))
        expected.append(float(value - value % c["difficulty_step"]))
    assert report["curriculum_legacy"] == expected == [2.0, 4.0, 4.0, 6.0, 6.0, 8.0, 8.0, 10.0]
