"""The plugins' grouped GEMM (MoE's ``--moe-grouped-gemm``) on the emulated vendor device against
``devshim_kernels``' loop of matmuls on the host, forward and backward, and the simulated ``npu_grouped_matmul``'s
documented semantics (Ascend: group_list as counts or cumulative ends, the row and the contraction-axis grouping),
and Megatron's MoE layer under ``moe_grouped_gemm`` training on the device as the ungrouped layer does
(``moe_grouped_job.py``, ``import devshim_core.auto`` as a training script runs it).

No fault is injected. What the user would see if the plugin's op were wrong: an MoE model whose experts compute
other values under ``--moe-grouped-gemm`` than without it. Run once per vendor, each in a process of its own:
``DEVSHIM_EMULATE=ascend pytest tests/emulated/test_grouped_gemm_emulated.py`` (or sophgo).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import devshim_kernels as dk
import pytest
import torch

from devshim_core.testing import compare
from emulated.conftest import DEVICE_TYPE, VENDOR, only

Tensor = torch.Tensor
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
SIZES = [5, 0, 9, 2]  # an expert without tokens, as routing gives
K, N = 8, 6
JOB = Path(__file__).with_name("moe_grouped_job.py")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_b", [False, True], ids=["KN", "NK-trans_b"])
def test_the_plugins_grouped_gemm_is_devshim_kernels_loop(plugin: Any, dtype: torch.dtype, trans_b: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = plugin.attention_kernels().grouped_gemm
    assert kernel is not None
    vendor_calls: list[int] = []
    if VENDOR == "ascend":  # count the vendor op's calls: forward, and both gradients in backward
        vendor_gmm = plugin._npu_gmm
        monkeypatch.setattr(plugin, "_npu_gmm", lambda *a, **kw: vendor_calls.append(1) or vendor_gmm(*a, **kw))
    inputs = {"x": torch.randn(sum(SIZES), K, dtype=dtype),
              "weight": torch.randn(len(SIZES), *((N, K) if trans_b else (K, N)), dtype=dtype)}

    def on_device(x: Tensor, weight: Tensor) -> Tensor:
        return kernel(x, weight, torch.tensor(SIZES, device=x.device), trans_b=trans_b)  # sizes on the device

    def on_host(x: Tensor, weight: Tensor) -> Tensor:
        return dk.grouped_gemm(x, weight, SIZES, trans_b=trans_b)

    out = compare.conform(on_device, on_host, inputs, ("x", "weight"), dtype, DEVICE_TYPE)
    assert out.dtype == dtype and out.shape == (sum(SIZES), N)
    assert len(vendor_calls) == (3 if VENDOR == "ascend" else 0)


def test_what_the_vendor_op_cannot_take_runs_devshim_kernels(plugin: Any) -> None:
    kernel = plugin.attention_kernels().grouped_gemm
    x, w = torch.randn(4, K, dtype=torch.float64), torch.randn(2, K, N, dtype=torch.float64)
    got = kernel(x.to(DEVICE_TYPE), w.to(DEVICE_TYPE), [1, 3])
    compare.close(got, dk.grouped_gemm(x, w, [1, 3]), DEVICE_TYPE)
    with pytest.raises(ValueError, match="sum to x's 4 rows"):  # devshim's error, whatever the vendor's
        kernel(x.float().to(DEVICE_TYPE), w.float().to(DEVICE_TYPE), [1, 2])


def test_the_grouped_moe_layer_trains_on_the_device_as_the_ungrouped_one() -> None:
    pytest.importorskip("megatron.core", reason="the MoE layers are Megatron's")
    done = subprocess.run([sys.executable, str(JOB)], capture_output=True, text=True, timeout=240)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, (f"the job exited {done.returncode}\n{done.stdout[-2000:]}\n"
                                            f"{done.stderr[-4000:]}")
    observed = json.loads(lines[-1])
    assert observed["experts"] == "GroupedMLP" and observed["grouped_gemm_plugin"] == VENDOR
    sequential, grouped = observed["sequential"], observed["grouped"]
    assert sequential["device"] == grouped["device"] == f"{DEVICE_TYPE}:0"
    for key in ("out", "dx", "losses"):  # fp32, same weights: only the order of operations differs
        torch.testing.assert_close(torch.tensor(grouped[key]), torch.tensor(sequential[key]), rtol=1e-5, atol=1e-5)
    assert grouped["losses"][-1] < grouped["losses"][0]


# -- Ascend: torch_npu.npu_grouped_matmul's documented semantics --------------------------------------------------


@only("ascend")
def test_npu_grouped_matmul_takes_counts_or_cumulative_ends_as_a_tensor_or_a_list() -> None:
    x, w = torch.randn(sum(SIZES), K), torch.randn(len(SIZES), K, N)
    expected = dk.grouped_gemm(x, w, SIZES)
    xd, wd = x.to(DEVICE_TYPE), w.to(DEVICE_TYPE)
    ends = torch.tensor(SIZES).cumsum(0).tolist()
    for group_list, kind in ((SIZES, 1), (torch.tensor(SIZES, device=DEVICE_TYPE), 1), (ends, 0)):
        [out] = torch.ops.npu.npu_grouped_matmul([xd], [wd], group_list=group_list, split_item=2, group_type=0,
                                                 group_list_type=kind)
        compare.close(out, expected, DEVICE_TYPE)
    per_group = torch.ops.npu.npu_grouped_matmul([xd], [wd], group_list=SIZES, split_item=0, group_type=0,
                                                 group_list_type=1)  # split_item 0/1: one output per group
    assert [tuple(o.shape) for o in per_group] == [(s, N) for s in SIZES]


@only("ascend")
def test_npu_grouped_matmul_group_type_2_splits_the_contraction_axis_into_per_group_products() -> None:
    x, dy = torch.randn(sum(SIZES), K), torch.randn(sum(SIZES), N)
    [dw] = torch.ops.npu.npu_grouped_matmul([x.to(DEVICE_TYPE).t()], [dy.to(DEVICE_TYPE)], group_list=SIZES,
                                            split_item=3, group_type=2, group_list_type=1)
    expected = torch.stack([a.t() @ b for a, b in zip(x.split(SIZES), dy.split(SIZES), strict=True)])
    compare.close(dw, expected, DEVICE_TYPE)


@only("ascend")
def test_npu_grouped_matmul_refuses_host_tensors_bad_group_lists_and_quantization() -> None:
    x, w = torch.randn(4, K), torch.randn(2, K, N)
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        torch.ops.npu.npu_grouped_matmul([x], [w.to(DEVICE_TYPE)], group_list=[1, 3], split_item=2, group_type=0,
                                         group_list_type=1)
    xd, wd = x.to(DEVICE_TYPE), w.to(DEVICE_TYPE)
    with pytest.raises(ValueError, match="must split the 4 entries"):
        torch.ops.npu.npu_grouped_matmul([xd], [wd], group_list=[1, 2], split_item=2, group_type=0, group_list_type=1)
    with pytest.raises(NotImplementedError, match="not emulated"):
        torch.ops.npu.npu_grouped_matmul([xd], [wd], scale=[torch.ones(N, device=DEVICE_TYPE)], group_list=[1, 3],
                                         split_item=2, group_type=0, group_list_type=1)
