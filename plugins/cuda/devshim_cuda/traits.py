"""Whether the device computes bf16 natively, and its name, for ``devshim_device_traits``: read without initialising
CUDA wherever the machine allows.

The traits are built at activation, at a training script's first line, whether or not ``DEVSHIM_CUDA_FACADE=1``
routes DeepSpeed through them (DeepSpeed's accelerator then answers ``is_bf16_supported()`` from them). torch's own
``torch.cuda.is_bf16_supported()`` and ``get_device_name(current_device())`` initialise CUDA (``_lazy_init``; on a GPU
older than Ampere ``is_bf16_supported()`` even allocates a tensor, creating a context), so they are asked only where
that adds nothing. The sources, first that answers:

1. torch, when this process has already initialised CUDA (``torch.cuda.is_initialized()``): exact, and free;
2. NVML for the GPU torch will number 0 (the first entry of ``CUDA_VISIBLE_DEVICES``, an index or a GPU UUID;
   the first GPU when unset): compute capability (``nvmlDeviceGetCudaComputeCapability``) and name
   (``nvmlDeviceGetName``). CUDA numbers devices fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` while NVML
   numbers them by PCI bus, so an index names one GPU only where that variable says PCI order or every GPU is the same
   model; on ROCm, amdsmi through torch's own helper (the GPU's gfx architecture and market name), when torch could
   import the ``amdsmi`` package;
3. torch, when detection had to count devices through the runtime (no NVML or amdsmi, MIG devices named in
   ``CUDA_VISIBLE_DEVICES``): the driver is initialised and fork poisoned already, so the exact answer costs nothing
   more that matters. Asked for the compute capability and the name only (``get_device_capability``,
   ``get_device_name``), never ``is_bf16_supported()``, which may create a context;
4. otherwise nothing is initialised and the answer is the least harmful one: on a machine mixing GPU models where the
   device cannot be told, bf16 if any candidate has it natively (CUDA puts the fastest first; were the guess wrong,
   torch emulates bf16 on the older GPU, slowly, as torch's and DeepSpeed's own ``is_bf16_supported()`` already
   accept there) and the candidates' names; where nothing could be read, bf16 and no name, as torch answers.

bf16 counts as supported when the device computes it natively: compute capability 8.0 or more (Ampere on), and on
ROCm MI100 on (gfx908, gfx90a, gfx94x, gfx95x) and RDNA3 on (gfx11xx, gfx12xx), or any ROCm GPU whose architecture
could not be read (torch answers True on every ROCm GPU). The plugin's ``DeviceTraits`` offer bf16 on every device
all the same, as torch's default ``is_bf16_supported()`` does (emulated on a V100 or T4): this module's answer is for
reports, and for the name.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import NamedTuple

import torch

from devshim_cuda import detect, nvml

NATIVE_BF16_MAJOR = 8  # compute capability 8.0: Ampere
# AMD architectures with bf16 in their matrix units: MI100, MI200, MI300, MI350, RDNA3, RDNA4
ROCM_NATIVE_BF16 = re.compile(r"^gfx(908|90a|94[0-9a-f]|95[0-9a-f]|11[0-9a-f]{2}|12[0-9a-f]{2})(:|$)")


class Traits(NamedTuple):
    bf16: bool
    name: str
    source: str  # where the answer came from, for tests and debugging


def read() -> Traits:
    return _rocm() if detect.hip_version() else _cuda()


# -- NVIDIA --------------------------------------------------------------------------------------------------------

def _leading_index(entry: str) -> int:
    """``CUDA_VISIBLE_DEVICES`` reads its entries as ``strtoul`` does (``1gpu2`` is 1); -1 where none is there."""
    found = re.match(r"\+?(\d+)", entry.strip())
    return int(found.group(1)) if found else -1


def first_visible(gpus: list[nvml.GPU]) -> list[nvml.GPU]:
    """The GPU torch will number 0 (``cuda:0``, the current device until the script sets one): one GPU where that can
    be known, every GPU the index may name where CUDA's order is not NVML's and the models differ, none where
    ``CUDA_VISIBLE_DEVICES`` names nothing NVML knows (or a MIG device)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = value.split(",")[0].strip() if value is not None else "0"
    if first.startswith("GPU-"):  # a UUID, or a prefix naming exactly one
        matches = [gpu for gpu in gpus if gpu.uuid.startswith(first)]
        return matches if len(matches) == 1 else []
    index = _leading_index(first)
    if index < 0 or index >= len(gpus):
        return []
    pci_order = os.environ.get("CUDA_DEVICE_ORDER", "").strip() == "PCI_BUS_ID"
    if pci_order or len({(gpu.name, gpu.capability) for gpu in gpus}) == 1:
        return [gpus[index]]
    return list(gpus)  # CUDA numbers the fastest first, NVML by PCI bus: which GPU the index names is not known


def _cuda_from_torch(why: str) -> Traits | None:
    try:
        major, _ = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
    except Exception:  # e.g. a PYTORCH_CUDA_ALLOC_CONF torch refuses at initialisation: the core reports that later
        return None
    return Traits(int(major) >= NATIVE_BF16_MAJOR, str(name), f"torch ({why})")


def _cuda() -> Traits:
    if torch.cuda.is_initialized():
        got = _cuda_from_torch("CUDA already initialised")
        if got is not None:
            return got
    gpus = nvml.gpus()
    candidates = first_visible(gpus) if gpus else []
    if len(candidates) == 1 and (capability := candidates[0].capability) is not None:
        gpu = candidates[0]
        return Traits(capability[0] >= NATIVE_BF16_MAJOR, gpu.name,
                      f"NVML: GPU {gpu.index}, compute capability {capability[0]}.{capability[1]}")
    if detect.runtime_counted():
        got = _cuda_from_torch("detection had already initialised the driver")
        if got is not None:
            return got
    if candidates:  # several GPUs the index may name, or one whose capability NVML did not give
        majors = [gpu.capability[0] for gpu in candidates if gpu.capability is not None]
        likeliest = sorted(candidates, key=lambda gpu: (tuple(-part for part in gpu.capability or (0, 0)), gpu.index))
        names = list(dict.fromkeys(gpu.name for gpu in likeliest if gpu.name))  # the newest first, as CUDA numbers
        return Traits(not majors or any(major >= NATIVE_BF16_MAJOR for major in majors), " or ".join(names),
                      f"NVML: one of GPUs {[gpu.index for gpu in candidates]}, not told apart")
    return Traits(True, "", "nothing could be read without initialising CUDA")


# -- AMD -----------------------------------------------------------------------------------------------------------

def gfx_name(version: object) -> str:
    """``gfx942`` from amdsmi's ``target_graphics_version``, given as that name or as the number ``90402``."""
    text = str(version).strip().lower()
    if text.startswith("gfx"):
        return text
    if not text.isdigit():
        return ""
    number = int(text)
    return f"gfx{number // 10000}{number // 100 % 100}{number % 100:x}"


def rocm_native_bf16(arch: str) -> bool:
    """bf16 on the architecture (``gfx90a:sramecc+:xnack-``), or True where it could not be read, as torch answers."""
    return not arch or bool(ROCM_NATIVE_BF16.match(arch.strip().lower()))


def _rocm_from_torch(why: str) -> Traits | None:
    try:
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    except Exception:
        return None
    arch = str(getattr(properties, "gcnArchName", "") or "")
    return Traits(rocm_native_bf16(arch), str(properties.name), f"torch ({why})")


def _amdsmi_first_visible() -> tuple[str, str] | None:
    """(gfx architecture, market name) of HIP's device 0 through torch's amdsmi helper, which honours the
    visible-devices variables and calls no HIP function; ``None`` without amdsmi."""
    handler = getattr(torch.cuda, "_get_amdsmi_handler", None)
    amdsmi = getattr(torch.cuda, "amdsmi", None)
    if handler is None or amdsmi is None or not getattr(torch.cuda, "_HAS_AMDSMI", False):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            info = amdsmi.amdsmi_get_gpu_asic_info(handler(0))
        except Exception:
            return None
    return gfx_name(info.get("target_graphics_version", "")), str(info.get("market_name", "") or "")


def _rocm() -> Traits:
    if torch.cuda.is_initialized():
        got = _rocm_from_torch("HIP already initialised")
        if got is not None:
            return got
    found = _amdsmi_first_visible()
    if found is not None:
        arch, name = found
        return Traits(rocm_native_bf16(arch), name, f"amdsmi: {arch or 'architecture unknown'}")
    if detect.runtime_counted():
        got = _rocm_from_torch("detection had already initialised the runtime")
        if got is not None:
            return got
    return Traits(True, "", "nothing could be read without initialising HIP")
