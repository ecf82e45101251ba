"""devshim plugin for Sophgo TPUs (SG2260, BM1684X), on Sophgo's ``torch_tpu``.

``torch_tpu`` is also the import name of Google's TorchTPU, which aborts the interpreter when imported
without Google's runtime, so detection reads metadata and files and imports only a package it has
identified as Sophgo's. Every other hook runs only once this plugin is selected.

Written against Sophgo's API (``torch.tpu``, ``sccl`` with ``ProcessGroupSCCLOptions``, ``torch.ops.my_ops``);
verified on devshim's emulated ``tpu`` (``DEVSHIM_EMULATE=sophgo``), never on Sophgo hardware.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from devshim_core import (
    AllocatorSpec,
    CollectivesSpec,
    DeviceReport,
    DeviceTraits,
    FusedKernels,
    OptimizerKernels,
    env_migration,
    hookimpl,
)
from devshim_core.records import EnvironmentMap
from devshim_sophgo import allocator
from devshim_sophgo.detect import detect

PRIORITY = 100
VISIBLE_DEVICES = "TPU_VISIBLE_DEVICES"


def _tpu() -> Any:
    importlib.import_module("torch_tpu")  # registers torch.tpu, the sccl backend and torch.ops.my_ops
    return torch.tpu  # type: ignore[attr-defined]  # registered by torch_tpu's import, just above


def chip() -> str:
    return os.environ.get("CHIP_ARCH", "sg2260").strip().lower() or "sg2260"


@hookimpl
def devshim_detect() -> DeviceReport:
    found = detect()
    return DeviceReport(available=found.ok, reason=found.reason, device_type="tpu",
                        device_count=found.device_count if found.ok else 0, priority=PRIORITY)


@hookimpl
def devshim_environment_map(report: DeviceReport) -> EnvironmentMap:
    # only what Sophgo documents: the visible devices and the allocator's variable; SCCL documents no NCCL_* twin
    return EnvironmentMap(
        variables={"CUDA_VISIBLE_DEVICES": VISIBLE_DEVICES, "PYTORCH_CUDA_ALLOC_CONF": allocator.CONFIG_ENV},
        convert={"CUDA_VISIBLE_DEVICES": env_migration.visible_devices,
                 "PYTORCH_CUDA_ALLOC_CONF": env_migration.allocator_config(allocator.KEYS, allocator.validate_config)})


@hookimpl
def devshim_device_module(report: DeviceReport) -> Any:
    return _tpu()


@hookimpl
def devshim_device_traits(report: DeviceReport) -> DeviceTraits:
    tpu = _tpu()
    return DeviceTraits(supported_dtypes=(torch.float32, torch.float16, torch.bfloat16), bf16_supported=True,
                        fp16_supported=True, fp64_supported=False, host_synchronous=False,
                        streams=chip() == "sg2260",  # only SG2260 has streams and events; BM1684X runs one queue
                        int64_supported=False,  # the vendor narrows int64 to int32 on the device
                        pin_memory=True, name=tpu.get_device_name(0))


def _sccl_options() -> dict[str, Any]:
    """``pg_options`` as Sophgo's adaptor builds them: the chip each local rank drives (SG2260 builds only)."""
    vendor_tpu = importlib.import_module("torch_tpu.tpu")
    if not hasattr(vendor_tpu, "ProcessGroupSCCLOptions"):
        return {}
    options = vendor_tpu.ProcessGroupSCCLOptions()
    vendor_tpu.set_chip_map(options, use_rank_table=False)
    return {"pg_options": options}


@hookimpl
def devshim_collectives(report: DeviceReport) -> CollectivesSpec:
    _tpu()
    return CollectivesSpec(backend="sccl", init_kwargs=_sccl_options(),
                           export_env_prefixes=("CHIP_", "TPU_", "SCCL", "PYTORCH_TPU", "LD_LIBRARY", "PATH"),
                           visible_devices_envs=(VISIBLE_DEVICES,), prepare=_tpu)


@hookimpl
def devshim_allocator(report: DeviceReport) -> AllocatorSpec:
    return AllocatorSpec.from_module(_tpu(), config_env=allocator.CONFIG_ENV, validate_config=allocator.validate_config)


@hookimpl
def devshim_optimizer_kernels(report: DeviceReport) -> OptimizerKernels:
    from devshim_sophgo import kernels

    return kernels.optimizer_kernels()


@hookimpl
def devshim_attention_kernels(report: DeviceReport) -> FusedKernels:
    from devshim_sophgo import kernels

    return kernels.attention_kernels()


@hookimpl
def devshim_runtime_versions(report: DeviceReport) -> dict[str, str]:
    from devshim_sophgo import versions

    return versions.runtime_versions()
