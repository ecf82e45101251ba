"""Spec: a script that runs ``import deepspeed`` before ``import devshim_core.auto`` still runs entirely on devshim's
accelerator: nothing in any ``deepspeed.*`` module keeps pointing at the accelerator DeepSpeed auto-detected first.

``import deepspeed`` makes DeepSpeed pick an accelerator of its own and bind pieces of it at module level: op-builder
classes (``deepspeed.ops.op_builder.FusedAdamBuilder`` & co., imported by ``deepspeed.ops.adam``), bound methods, and
``functools.partial(torch.amp.custom_fwd, device_type=<its name>)``. Under emulation DeepSpeed's own detection finds
the simulated SDK where it can: on ascend ``torch_npu`` is importable, so it picks its ``NPU_Accelerator`` (builders
from ``deepspeed.ops.op_builder.npu``); it has no Sophgo accelerator, so on sophgo it picks ``CPU_Accelerator``
(builders from ``deepspeed.ops.op_builder.cpu``). A fresh process per run: the import order is the point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from emulated.conftest import DEVICE_TYPE, VENDOR

DEEPSPEED_FIRST = r"""
import functools, inspect, json, sys

import deepspeed
from deepspeed.accelerator import get_accelerator

old = get_accelerator()
old_builders = old.op_builder_dir()
stale_packages = tuple(sorted({"deepspeed.ops.op_builder.cpu", "deepspeed.ops.op_builder.npu",
                               old_builders if old_builders.startswith("deepspeed.") else "deepspeed." + old_builders}))

import devshim_core.auto  # noqa: E402  (the point: after deepspeed)

new = get_accelerator()


def from_stale_package(cls):
    module = getattr(cls, "__module__", "") or ""
    return any(module == p or module.startswith(p + ".") for p in stale_packages)


stale, partials, scanned = [], [], 0
for name, module in sorted(sys.modules.items()):
    if module is None or not (name == "deepspeed" or name.startswith("deepspeed.")):
        continue
    if any(name == p or name.startswith(p + ".") for p in stale_packages):
        continue  # where the old builders are defined, not where anyone picked them up
    scanned += 1
    for attr, value in list(vars(module).items()):
        if value is old:
            stale.append([name, attr, f"the auto-detected accelerator ({type(old).__name__})"])
        elif inspect.ismethod(value) and value.__self__ is old:
            stale.append([name, attr, f"bound method {type(old).__name__}.{value.__name__}"])
        elif isinstance(value, type) and from_stale_package(value):
            stale.append([name, attr, f"class {value.__module__}.{value.__qualname__}"])
        elif not isinstance(value, type) and from_stale_package(type(value)):
            stale.append([name, attr, f"instance of {type(value).__module__}.{type(value).__qualname__}"])
        elif isinstance(value, functools.partial) and "device_type" in value.keywords:
            partials.append([name, attr, value.keywords["device_type"]])

print(json.dumps({
    "detected": type(old).__name__, "detected_name": old._name, "detected_builders": old_builders,
    "accelerator": type(new).__module__ + "." + type(new).__name__, "device": new.device_name(),
    "replaced": getattr(new, "_devshim_replaced", None) is old, "stale_packages": stale_packages,
    "scanned": scanned, "stale": stale, "partials": partials,
    "FusedAdamBuilder": deepspeed.ops.op_builder.FusedAdamBuilder.__module__,
}))
"""

DETECTED = {"ascend": ("NPU_Accelerator", "npu", "deepspeed.ops.op_builder.npu"),
            "sophgo": ("CPU_Accelerator", "cpu", "deepspeed.ops.op_builder.cpu")}


@pytest.fixture(scope="module")
def deepspeed_first() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "DEVSHIM_AUTO")}
    result = subprocess.run([sys.executable, "-c", DEEPSPEED_FIRST], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_deepspeed_imported_first_auto_detects_its_own_accelerator_for_the_simulated_sdk(deepspeed_first):
    found = (deepspeed_first["detected"], deepspeed_first["detected_name"], deepspeed_first["detected_builders"])
    assert found == DETECTED[VENDOR]


def test_after_devshim_get_accelerator_is_devshims_on_the_vendor_device(deepspeed_first):
    assert deepspeed_first["accelerator"] == "devshim_core.integrations.deepspeed.accelerator.DevshimAccelerator"
    assert deepspeed_first["device"] == DEVICE_TYPE
    assert deepspeed_first["replaced"] is True
    assert deepspeed_first["FusedAdamBuilder"].startswith("devshim_core.integrations.deepspeed.op_builders")


def test_no_deepspeed_module_keeps_a_reference_to_the_auto_detected_accelerator_or_its_builders(deepspeed_first):
    assert deepspeed_first["scanned"] > 100  # the scan covered DeepSpeed's import-time modules
    stale = "\n".join(f"  {module}.{attr}: {what}" for module, attr, what in deepspeed_first["stale"])
    assert not stale, f"stale references left by `import deepspeed` before devshim:\n{stale}"


def test_every_autocast_partial_in_deepspeed_names_the_vendor_device(deepspeed_first):
    """``partial(custom_fwd, device_type=...)`` bound at import must name devshim's device: on sophgo the
    auto-detected name was ``cpu`` and is rebound to ``tpu``; on ascend DeepSpeed's own name was already ``npu``."""
    assert deepspeed_first["partials"], "no autocast partial found: the scan no longer sees what it should"
    wrong = [p for p in deepspeed_first["partials"] if p[2] != DEVICE_TYPE]
    assert not wrong, f"partials still bound to another device: {wrong}"
