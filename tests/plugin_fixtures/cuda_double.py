"""A test double of an NVIDIA host for a machine without one: a plugin that reports a ``cuda`` device (backed by the
host CPU's device module), as the ``cuda`` plugin does where torch's CUDA runtime sees a GPU."""

import torch
from devshim_cpu_reference import memory
from devshim_cpu_reference.device_module import CpuDeviceModule

from devshim_core import AllocatorSpec, CollectivesSpec, DeviceReport, DeviceTraits, hookimpl


@hookimpl
def devshim_detect() -> DeviceReport:
    return DeviceReport(available=True, reason="CUDA 12.4, 1 x test double", device_type="cuda", device_count=1,
                        priority=50)


@hookimpl
def devshim_device_module(report: DeviceReport) -> CpuDeviceModule:
    return CpuDeviceModule(report.device_count)


@hookimpl
def devshim_device_traits(report: DeviceReport) -> DeviceTraits:
    return DeviceTraits(supported_dtypes=(torch.float32, torch.bfloat16), bf16_supported=True, fp16_supported=True,
                        host_synchronous=True, streams=False, name="test double")


@hookimpl
def devshim_collectives(report: DeviceReport) -> CollectivesSpec:
    return CollectivesSpec("nccl", visible_devices_envs=("CUDA_VISIBLE_DEVICES",))


@hookimpl
def devshim_allocator(report: DeviceReport) -> AllocatorSpec:
    return memory.allocator_spec()
