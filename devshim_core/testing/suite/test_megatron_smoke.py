"""Kit: megatron-core's tensor parallelism (TP=2 over 2 ranks) on the plugin under test.

A column-parallel then row-parallel MLP trains for a few SGD steps; each rank also runs the same MLP with the
gathered full weights in plain PyTorch on the host. The losses and the final weights must match within
``RTOL``/``ATOL`` (fp32; the sharded matmuls sum in another order than the full ones). The model-parallel RNG
tracker must give each TP rank its own stream on the device, and the default generator the same stream.

On a CUDA device devshim does not patch Megatron (each rank reports its ``megatron_integration`` as skipped): the
same checks then hold Megatron's own CUDA paths, on the devices, backend (NCCL) and RNG the plugin declares, to the
host's numerics. Skipped, saying why, where the plugin reports fewer than 2 devices.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="the Megatron smoke run needs megatron-core (devshim-core[megatron])")

from devshim_core.testing.launch import two_rank_reports

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def ranks(devshim_device: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return two_rank_reports(devshim_device, tmp_path_factory.mktemp("megatron-smoke"), "megatron_smoke")


def test_each_rank_holds_its_shard_on_its_own_device(ranks: list[dict[str, Any]], devshim_device: Any) -> None:
    assert [r["tp_rank"] for r in ranks] == [0, 1] and {r["tp_size"] for r in ranks} == {2}
    for report in ranks:
        assert report["plugin"] == devshim_device.plugin, report
        assert report["weight_device"] == devshim_device.device_name(report["local_rank"]), report
        assert report["shard_shapes"] == [[32, 16], [16, 32]], report  # half of [64, 16] and of [16, 64]
        assert report["backend"] == devshim_device.collectives.backend, report


def test_the_tensor_parallel_mlp_trains_as_the_full_mlp_on_the_host(ranks: list[dict[str, Any]]) -> None:
    for report in ranks:
        torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(report["reference_losses"]),
                                   rtol=RTOL, atol=ATOL)
        assert max(report["final_weight_difference"].values()) <= ATOL + RTOL, report["final_weight_difference"]
    assert ranks[0]["losses"] == ranks[1]["losses"], "TP ranks computed different losses for the same batch"


def test_the_model_parallel_rng_forks_per_rank_on_the_device(ranks: list[dict[str, Any]]) -> None:
    for report in ranks:
        assert report["rng"] == {"forked_draws_differ": True, "default_draws_agree": True,
                                 "forked_on_device": True}, report
