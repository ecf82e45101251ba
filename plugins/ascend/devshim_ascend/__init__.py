"""devshim plugin for Huawei Ascend NPUs, on ``torch_npu`` and CANN.

Detection never imports torch_npu before it has seen the CANN runtime: without CANN, importing torch_npu
fails (and, installed, it can break ``import torch`` through its ``torch.backends`` entry point). Every
other hook runs only once this plugin is selected, so ``torch_npu`` is imported by then.

Written against Huawei's API (``torch.npu``, ``hccl``, ``torch_npu.npu_*``); verified on devshim's emulated
``npu`` (``DEVSHIM_EMULATE=ascend``), never on Ascend hardware.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from devshim_ascend import allocator
from devshim_ascend.detect import detect
from devshim_core import (
    AllocatorSpec,
    CollectivesSpec,
    DeviceReport,
    DeviceTraits,
    FusedKernels,
    OptimizerKernels,
    hookimpl,
)
from devshim_core.records import EnvironmentMap

PRIORITY = 100
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"


def _npu() -> Any:
    importlib.import_module("torch_npu")  # registers torch.npu and the hccl backend
    return torch.npu  # type: ignore[attr-defined]  # registered by torch_npu's import, just above


@hookimpl
def devshim_detect() -> DeviceReport:
    found = detect()
    return DeviceReport(available=found.ok, reason=found.reason, device_type="npu",
                        device_count=found.device_count if found.ok else 0, priority=PRIORITY)


@hookimpl
def devshim_environment_map(report: DeviceReport) -> EnvironmentMap:
    from devshim_ascend import environment

    return environment.environment_map()


@hookimpl
def devshim_device_module(report: DeviceReport) -> Any:
    return _npu()


@hookimpl
def devshim_device_traits(report: DeviceReport) -> DeviceTraits:
    npu = _npu()
    bf16 = bool(npu.is_bf16_supported())
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if bf16 else (torch.float32, torch.float16)
    return DeviceTraits(supported_dtypes=dtypes, bf16_supported=bf16, fp16_supported=True, fp64_supported=True,
                        host_synchronous=False, streams=True, int64_supported=True, pin_memory=True,
                        name=npu.get_device_name(0))


def _register_hccl() -> None:
    _npu()  # importing torch_npu registers hccl with torch.distributed; nothing else is per-process


@hookimpl
def devshim_collectives(report: DeviceReport) -> CollectivesSpec:
    # DeepSpeed's NPU accelerator forwards these prefixes to remote ranks; CANN needs its paths there too
    return CollectivesSpec(backend="hccl", export_env_prefixes=("ASCEND", "HCCL", "LD_LIBRARY", "PATH"),
                           visible_devices_envs=(VISIBLE_DEVICES,), prepare=_register_hccl)


@hookimpl
def devshim_allocator(report: DeviceReport) -> AllocatorSpec:
    return AllocatorSpec.from_module(_npu(), config_env=allocator.CONFIG_ENV, validate_config=allocator.validate_config)


@hookimpl
def devshim_optimizer_kernels(report: DeviceReport) -> OptimizerKernels:
    from devshim_ascend import kernels

    return kernels.optimizer_kernels()


@hookimpl
def devshim_attention_kernels(report: DeviceReport) -> FusedKernels:
    from devshim_ascend import kernels

    return kernels.attention_kernels()


@hookimpl
def devshim_runtime_versions(report: DeviceReport) -> dict[str, str]:
    from devshim_ascend import versions

    return versions.runtime_versions()
