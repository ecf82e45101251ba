"""devshim's reference plugin: the CPU as a device. Always available, lowest priority.

Every rank of a job shares the host; ``device_count`` is how many ranks a launcher may place on it
(DEVSHIM_CPU_DEVICE_COUNT, else the launcher's local world size, else 1).
"""

from __future__ import annotations

import platform

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
    host_defaults,
)
from devshim_core.records import EnvironmentMap
from devshim_cpu_reference import memory
from devshim_cpu_reference.device_module import VISIBLE_DEVICES_ENV, CpuDeviceModule, configured_device_count

PRIORITY = -1000  # the fallback: any other available plugin wins


@hookimpl
def devshim_detect() -> DeviceReport:
    count, source = configured_device_count()
    return DeviceReport(available=True, reason=f"the host CPU is always available ({count} device slots, {source})",
                        device_type="cpu", device_count=count, priority=PRIORITY)


@hookimpl
def devshim_environment_map(report: DeviceReport) -> EnvironmentMap:
    # CUDA_VISIBLE_DEVICES narrows the CPU's device slots as it narrows GPUs; NCCL and CUDA's allocator are not used
    return EnvironmentMap(variables={"CUDA_VISIBLE_DEVICES": VISIBLE_DEVICES_ENV},
                          convert={"CUDA_VISIBLE_DEVICES": env_migration.visible_devices},
                          ignored=("NCCL_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF"))


@hookimpl
def devshim_device_module(report: DeviceReport) -> CpuDeviceModule:
    return CpuDeviceModule(report.device_count)


@hookimpl
def devshim_device_traits(report: DeviceReport) -> DeviceTraits:
    return DeviceTraits(
        supported_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        bf16_supported=True,
        fp16_supported=True,
        host_synchronous=True,
        streams=False,  # torch.cpu's stream/event classes lack most of the CUDA API; use host-side ones
        pin_memory=False,  # host memory is the device memory: nothing to page-lock
        name=platform.processor() or platform.machine() or "CPU",
    )


@hookimpl
def devshim_collectives(report: DeviceReport) -> CollectivesSpec:
    return CollectivesSpec(backend="gloo", export_env_prefixes=("OMP", "KMP"),
                           visible_devices_envs=("DEVSHIM_CPU_VISIBLE_DEVICES",))


@hookimpl
def devshim_allocator(report: DeviceReport) -> AllocatorSpec:
    return memory.allocator_spec()


@hookimpl
def devshim_optimizer_kernels(report: DeviceReport) -> OptimizerKernels:
    return host_defaults.reference_optimizer_kernels()


@hookimpl
def devshim_attention_kernels(report: DeviceReport) -> FusedKernels:
    return host_defaults.reference_fused_kernels()
