"""Spec: on a CUDA device devshim stands aside. DeepSpeed, Megatron, apex, TransformerEngine and flash-attn run as
they would without devshim: no CUDA redirect, no blocked module, no DeepSpeed or Megatron patch, no job-level
``torch.distributed`` patch; ``devshim info`` says so in one line. ``DEVSHIM_CUDA_FACADE=1`` routes DeepSpeed (only)
through devshim's accelerator.

This machine has no GPU: a test double plugin reports a ``cuda`` device (``plugin_fixtures.cuda_double``), selected
over ``cpu_reference`` by its priority, as the ``cuda`` plugin is on an NVIDIA host.
"""

from __future__ import annotations

import json

import pytest
from plugin_fixtures import DEVSHIM_SCRIPT, PYTHON, TESTS_DIR, clean_env, run, write_distribution

PROBE = """
import importlib.util, json, sys
import torch
original_is_available = torch.cuda.is_available
import devshim_core.auto as auto
from devshim_core.patching import REGISTRY
import transformer_engine, flash_attn, apex  # installed here as stand-ins: devshim must not block them
from deepspeed.accelerator import get_accelerator
print(json.dumps({
    "selected": auto.session.selection.plugin.name,
    "device": auto.device.type,
    "integrations": auto.session.integrations,
    "patch sets": sorted({row["set"] for row in REGISTRY.report()}),
    "found": [importlib.util.find_spec(n) is not None for n in ("transformer_engine", "flash_attn", "apex")],
    "torch.cuda.is_available untouched": torch.cuda.is_available is original_is_available,
    "accelerator": type(get_accelerator()).__name__,
    "accelerator device": get_accelerator().device_name(),
}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("cuda-host-double")
    write_distribution(site, "devshim-cuda-double", "0.0.1", {"cuda_double": "plugin_fixtures.cuda_double"})
    for package in ("transformer_engine", "flash_attn", "apex"):
        (site / package).mkdir()
        (site / package / "__init__.py").write_text("REAL = True\n")
    return site


def _probe(site, **env: str) -> dict:
    result = run([PYTHON, "-c", PROBE], _env(site, **env))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])  # DeepSpeed's own accelerator prints a warning first


def _env(site, **env: str) -> dict[str, str]:
    return clean_env(pythonpath=[site, TESTS_DIR], DEVSHIM_DISABLED_PLUGINS="ascend,sophgo,cuda", **env)


def test_selected_cuda_device_leaves_every_framework_and_extension_as_it_is(site):
    report = _probe(site)
    assert (report["selected"], report["device"]) == ("cuda_double", "cuda")
    assert report["integrations"] == {
        "devshim": "stands aside: the device is CUDA, so DeepSpeed and Megatron run their own CUDA paths and nothing "
                   "is redirected or blocked (DEVSHIM_CUDA_FACADE=1 routes DeepSpeed through devshim's facade)"}
    assert report["patch sets"] == []
    assert report["found"] == [True, True, True]
    assert report["torch.cuda.is_available untouched"] is True
    assert report["accelerator"] != "DevshimAccelerator"


def test_devshim_cuda_facade_routes_deepspeed_through_devshim_and_nothing_else(site):
    report = _probe(site, DEVSHIM_CUDA_FACADE="1")
    assert report["accelerator"] == "DevshimAccelerator" and report["accelerator device"] == "cuda"
    assert report["integrations"]["cuda-redirect"] == "skipped: the selected device is CUDA"
    assert report["integrations"]["megatron"] == ("skipped: the device is CUDA, where Megatron runs its own CUDA "
                                                  "paths")
    assert "applied" in report["integrations"]["deepspeed"]
    assert "cuda-redirect" not in report["patch sets"] and "megatron-extension-modules" not in report["patch sets"]
    assert report["found"] == [True, True, True] and report["torch.cuda.is_available untouched"] is True


def test_devshim_info_says_it_stands_aside_in_one_line(site):
    result = run([DEVSHIM_SCRIPT, "info"], _env(site))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "stands aside" in line]
    assert len(lines) == 1 and lines[0].split()[0] == "devshim", result.stdout
    as_json = json.loads(run([DEVSHIM_SCRIPT, "info", "--json"], _env(site)).stdout)
    assert as_json["patches"] == [] and as_json["selected"] == "cuda_double"
