"""Kit: a 2-rank DeepSpeed job (ZeRO-2, fp32, AdamW) on the plugin under test, against the same training in one
host process with ``torch.optim.AdamW``.

The job runs under ``torchrun`` with this process's environment. Each rank must have used devshim's accelerator
for the plugin under test, on the device index its local rank names, over the plugin's backend, with the
plugin's fused AdamW when it has one, and compiled nothing. Every rank's loss at every step, and the final
parameters, must match the host reference within ``RTOL``: the job's kernels may round differently from the
host's (fused Adam, device matmuls), by far less than one step's progress. Skipped, saying why, where the plugin
reports fewer than 2 devices; on a CUDA device the job runs on devshim's accelerator because the kit sets
``DEVSHIM_CUDA_FACADE=1``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed", reason="the DeepSpeed smoke run needs DeepSpeed (devshim-core[deepspeed])")

from devshim_core.testing.launch import two_rank_reports
from devshim_core.testing.smoke import reference

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def ranks(devshim_device: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return two_rank_reports(devshim_device, tmp_path_factory.mktemp("deepspeed-smoke"), "deepspeed_smoke")


def test_each_rank_trained_through_the_plugin_on_its_own_device(ranks: list[dict[str, Any]], devshim_device: Any
                                                                ) -> None:
    for report in ranks:
        assert report["plugin"] == devshim_device.plugin and report["accelerator"] == "DevshimAccelerator", report
        assert report["backend"] == devshim_device.collectives.backend, report
        assert report["param_devices"] == [devshim_device.device_name(report["local_rank"])], report
        assert report["optimizer"] == "DeepSpeedZeroOptimizer", report
        if report["fused"]:
            assert report["basic_optimizer"] == "FusedAdam", report


def test_the_losses_and_final_parameters_match_one_host_process(ranks: list[dict[str, Any]]) -> None:
    losses, params = reference(world=2)
    for rank, report in enumerate(ranks):
        expected = [step[rank] for step in losses]

        def differ(m: str, rank: int = rank) -> str:
            return f"rank {rank}'s losses differ from the host's: {m}"

        torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(expected), rtol=RTOL, atol=ATOL,
                                   msg=differ)
    assert len(ranks[0]["params"]) == len(params)
    for got, want in zip(ranks[0]["params"], params, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=RTOL, atol=ATOL)
