"""What ``devshim check`` knows beyond the redirect's own tables (those are read from ``coverage``, never copied).

Each finding falls in exactly one category:

- ``redirected``: devshim's CUDA redirect serves it on the selected device;
- ``provided``: a CUDA extension import that devshim's Megatron integration provides or guards;
- ``review``: it runs, but answers differently than on CUDA;
- ``unsupported``: it cannot run off CUDA; the script must change (exit status 1).
"""

from __future__ import annotations

import re
from typing import Literal

from devshim_core.integrations.cuda_redirect import coverage

Category = Literal["redirected", "provided", "review", "unsupported"]
CATEGORIES: tuple[Category, ...] = ("redirected", "provided", "review", "unsupported")

# CUDA extension modules that devshim's Megatron integration provides (or guards) when megatron-core is installed:
# importing them is fine on any plugin's device. A module matches itself and everything under it.
PROVIDED_BY_MEGATRON_INTEGRATION: frozenset[str] = frozenset({
    "fused_weight_gradient_mlp_cuda", "amp_C", "fused_layer_norm_cuda", "apex.normalization",
    "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda",
    "apex.multi_tensor_apply",
})
PROVIDED_MESSAGE = "provided by devshim's Megatron integration when megatron-core is installed"

_SDPA = "use torch.nn.functional.scaled_dot_product_attention"
# CUDA-only packages: a script importing them must change. A module matches itself and everything under it.
UNSUPPORTED_MODULES: dict[str, str] = {
    "transformer_engine": "Transformer Engine is CUDA-only; use Megatron's local (non-TE) layer specs and plain torch",
    "flash_attn": f"FlashAttention's kernels are CUDA-only; {_SDPA}",
    "xformers": f"xFormers' kernels are CUDA-only; {_SDPA}",
    "triton": "Triton compiles kernels for NVIDIA/AMD GPUs only; write the op in PyTorch",
    "cupy": "CuPy arrays live in CUDA memory; use torch tensors",
    "pynvml": "NVML queries NVIDIA's driver; use the torch.cuda memory and device queries, which are redirected",
    "bitsandbytes": "bitsandbytes' kernels are CUDA-only; use unquantized layers and a torch.optim optimizer",
    "apex.amp": "apex.amp is CUDA-only (and deprecated); use torch.autocast and torch.amp.GradScaler",
    "apex.parallel": "apex.parallel is CUDA-only; use torch's DistributedDataParallel and torch.nn.SyncBatchNorm",
    "apex.contrib": "apex.contrib's kernels are CUDA-only; replace them with their PyTorch equivalents",
    "apex.optimizers": "apex's fused optimizers are CUDA-only; use torch.optim or the DeepSpeed config's optimizer",
    "torch.cuda.jiterator": coverage.UNSERVED_CUDA["jiterator"],
}

# an import inside ``try: ... except ImportError:`` has a fallback: the script still runs, on the fallback
GUARDED_IMPORT_MESSAGE = "{why}; the import is guarded by an except clause, so check that the fallback does the job"
IMPORT_ERRORS: frozenset[str] = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})

# the torch.utils.cpp_extension builders: CUDAExtension always needs nvcc; load/load_inline only with CUDA sources
CPP_EXTENSION = "torch.utils.cpp_extension"
CUDA_EXTENSION_MESSAGE = "builds CUDA sources with nvcc; port the kernel to the plugin's SDK or write the op in PyTorch"
CUDA_SOURCE = re.compile(r"\.(cu|cuh)$")

# review: attribute chains that run but mean nothing (or something else) off CUDA
REVIEW_PREFIXES: dict[str, str] = {
    "torch.backends.cudnn": "cuDNN settings have no effect off CUDA",
    "torch.backends.cuda": "torch.backends.cuda settings have no effect off CUDA",
    "torch.version.cuda": "torch.version.cuda is None without a CUDA build of torch; do not branch on it",
    "torch.has_cuda": "torch.has_cuda is False without a CUDA build of torch; do not branch on it",
}
IS_CUDA_MESSAGE = ".is_cuda is False for tensors on {device}; test for the device type you mean"

# string literals that name CUDA things; a whole literal must match (so docstrings and messages never do)
CUDA_DEVICE = re.compile(r"cuda(:(\d+|%d|%s|\{\w*\})?)?")  # 'cuda', 'cuda:1', 'cuda:', 'cuda:%d', 'cuda:{}'
NCCL = "nccl"
TENSOR_TYPE_NAME = re.compile(r"torch\.cuda\.(\w+)")  # tensor.type('torch.cuda.HalfTensor')
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CUDA_ENV = re.compile(r"(PYTORCH_)?CUDA_[A-Z0-9_]+")
NCCL_ENV = re.compile(r"NCCL_[A-Z0-9_]+")

# names that hold a device index in training scripts: .to(local_rank) means cuda:<local_rank> on CUDA
DEVICE_INDEX_NAME = re.compile(r"(.*_)?(rank|gpu|gpu_id|device_id|device_index)", re.IGNORECASE)

REDIRECT_OFF_MESSAGE = "DEVSHIM_REDIRECT_CUDA=0 turns the redirect off"


def module_rule(module: str) -> tuple[Category, str] | None:
    """The category and message for importing ``module`` (or using a name under it), or ``None``."""
    for prefix in _prefixes(module):
        if prefix in PROVIDED_BY_MEGATRON_INTEGRATION:
            return "provided", PROVIDED_MESSAGE
        if prefix in UNSUPPORTED_MODULES:
            return "unsupported", UNSUPPORTED_MODULES[prefix]
    return None


def _prefixes(dotted: str) -> list[str]:
    """'a.b.c' -> ['a.b.c', 'a.b', 'a']: the longest match wins."""
    parts = dotted.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def torch_cuda_rule(path: list[str]) -> tuple[Category, str]:
    """Classify ``torch.cuda.<path>`` (``path`` is what follows ``torch.cuda``, at least one name)."""
    head, rest = path[0], path[1:]
    if head in coverage.UNSERVED_CUDA:
        return "unsupported", coverage.UNSERVED_CUDA[head]
    if head == "amp" and (not rest or rest[0] in coverage.AMP_NAMES):
        return "redirected", "torch.cuda.amp runs as torch.amp on {device}"
    if head == "nvtx" and (not rest or rest[0] in coverage.NVTX_FUNCTIONS):
        return "redirected", "NVTX markers become torch.profiler ranges"
    if head == "random" and rest and rest[0] in coverage.DEVICE_FUNCTIONS:  # the module torch.cuda's RNG names live in
        return "redirected", "answered by {device}'s device module"
    if head in coverage.TENSOR_TYPES:
        return "redirected", f"a {coverage.TENSOR_TYPES[head]} tensor type on {{device}}"
    if head in coverage.DEVICE_FUNCTIONS or head in coverage.INTERNALS:
        return "redirected", "answered by {device}'s device module"
    name = ".".join(["torch.cuda", head, *rest[:1]])
    return "review", f"{name} is not redirected; check what it does without CUDA"


def review_prefix_rule(dotted: str) -> str | None:
    for prefix in _prefixes(dotted):
        if prefix in REVIEW_PREFIXES:
            return REVIEW_PREFIXES[prefix]
    return None
