"""devshim plugin for NVIDIA GPUs, and AMD GPUs on ROCm, through ``torch.cuda`` and NCCL (RCCL on ROCm).

Available where a device is counted: through NVML (amdsmi on ROCm), or the runtime where those cannot. Its priority,
50, is below the vendor plugins' (100: an Ascend or Sophgo device in a machine that also has a GPU is what the job
was sent there for) and far above ``cpu_reference``'s (-1000). With the device type ``cuda`` selected, devshim
stands aside: nothing is redirected or blocked and DeepSpeed and Megatron run their own CUDA paths;
``DEVSHIM_CUDA_FACADE=1`` routes DeepSpeed through devshim's accelerator and op builders, which then run this
plugin's kernels. Every kernel is plain torch (:mod:`devshim_cuda.kernels`), independent of ``devshim_kernels``'
compute, and runs on CPU tensors as well.

Nothing here initialises CUDA where the driver's NVML library (amdsmi on ROCm) answers: detection counts devices
through it (:mod:`devshim_cuda.detect`), the traits read bf16 support and the name through it
(:mod:`devshim_cuda.traits`), and the other hooks only bind torch's functions, which initialise CUDA when the script
calls them. The cases where CUDA may still be initialised are listed in those two modules.
"""

from __future__ import annotations

import torch

from devshim_core import (
    AllocatorSpec,
    CollectivesSpec,
    DeviceReport,
    DeviceTraits,
    FusedKernels,
    OptimizerKernels,
    hookimpl,
    host_defaults,
)
from devshim_cuda import allocator, detect, traits

PRIORITY = 50  # between the vendor plugins (100) and the CPU fallback (-1000)
DEVICE_TYPE = "cuda"  # on ROCm too: torch's HIP build drives AMD GPUs as "cuda" devices
# what a launcher forwards to remote ranks: NCCL's and torch's NCCL switches, the CUDA runtime's; ROCm's on ROCm
CUDA_PREFIXES = ("NCCL", "TORCH_NCCL", "CUDA", "PYTORCH_CUDA", "NVIDIA")
HIP_PREFIXES = ("NCCL", "RCCL", "TORCH_NCCL", "HIP", "HSA", "ROCR", "ROCM", "PYTORCH_HIP", "CUDA", "PYTORCH_CUDA")


@hookimpl
def devshim_detect() -> DeviceReport:
    found = detect.detect()
    return DeviceReport(available=found.ok, reason=found.reason, device_type=DEVICE_TYPE,
                        device_count=found.device_count if found.ok else 0, priority=PRIORITY)


@hookimpl
def devshim_device_module(report: DeviceReport) -> object:
    return torch.cuda


@hookimpl
def devshim_device_traits(report: DeviceReport) -> DeviceTraits:
    found = traits.read()  # NVML or amdsmi: CUDA is not initialised (devshim_cuda.traits says when it may be)
    # bf16 as torch's default is_bf16_supported() answers, emulation included, which DeepSpeed's own CUDA accelerator
    # asks: a bf16 config that runs without devshim must run with DEVSHIM_CUDA_FACADE=1 too, natively or not
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    return DeviceTraits(supported_dtypes=dtypes, bf16_supported=True, fp16_supported=True, fp64_supported=True,
                        host_synchronous=False, streams=True, int64_supported=True, pin_memory=True,
                        name=str(found.name))


@hookimpl
def devshim_collectives(report: DeviceReport) -> CollectivesSpec:
    prefixes = HIP_PREFIXES if detect.hip_version() else CUDA_PREFIXES
    return CollectivesSpec(backend="nccl", export_env_prefixes=prefixes,
                           visible_devices_envs=detect.visible_devices_envs())


@hookimpl
def devshim_allocator(report: DeviceReport) -> AllocatorSpec:
    return AllocatorSpec.from_module(torch.cuda, config_env=allocator.config_env(rocm=bool(detect.hip_version())),
                                     validate_config=allocator.validate_config)


@hookimpl
def devshim_optimizer_kernels(report: DeviceReport) -> OptimizerKernels:
    from devshim_cuda import kernels

    return host_defaults.optimizer_kernels(
        kernels.fused_adamw, "fused_adamw: torch._fused_adamw_/_fused_adam_ (devshim_cuda.kernels; written out in fp32 "
                             "without bias correction, for mixed dtypes or strided tensors)")


@hookimpl
def devshim_attention_kernels(report: DeviceReport) -> FusedKernels:
    from devshim_cuda import kernels

    return FusedKernels(
        attention=kernels.attention, rms_norm=kernels.rms_norm, swiglu=kernels.swiglu, rotary=kernels.rotary,
        masked_softmax=kernels.masked_softmax, wgrad_accumulate=kernels.wgrad_accumulate,
        source="torch (devshim_cuda.kernels): F.scaled_dot_product_attention, F.rms_norm, F.silu and plain tensor ops")


@hookimpl
def devshim_runtime_versions(report: DeviceReport) -> dict[str, str] | None:
    from devshim_cuda import versions

    return versions.runtime_versions() or None  # None: nothing could be read
