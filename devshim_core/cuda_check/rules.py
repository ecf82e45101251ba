"""What ``devshim check`` knows beyond the redirect's own tables (those are read from ``coverage``, never copied).

Each finding falls in exactly one category:

- ``redirected``: devshim's CUDA redirect serves it on the selected device;
- ``provided``: a CUDA extension module devshim provides: the import works;
- ``blocked``: a guarded import of a module devshim blocks off CUDA: it raises, and the script's fallback runs;
- ``review``: it runs, but answers differently than on CUDA;
- ``unsupported``: it cannot run off CUDA; the script must change (exit status 1).

``review`` and ``unsupported`` are the problems: what needs the user (``--only problems``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

from devshim_core.integrations.cuda_redirect import coverage

Category = Literal["redirected", "provided", "blocked", "review", "unsupported"]
CATEGORIES: tuple[Category, ...] = ("redirected", "provided", "blocked", "review", "unsupported")
PROBLEMS: tuple[Category, ...] = ("review", "unsupported")

# CUDA extension modules devshim's Megatron integration provides (extension_modules.provided builds them for the device,
# so they are named here; tests/test_cuda_check.py imports each under devshim). The megatron-core stand-in it also
# provides when triton is missing is Megatron's own module, not a CUDA extension a script imports.
_SOFTMAX = ("provided by devshim's Megatron integration (on the plugin's masked_softmax) when Megatron is "
            "importable")
PROVIDED: dict[str, str] = {
    "fused_weight_gradient_mlp_cuda": "provided by devshim's Megatron integration (on the plugin's wgrad_accumulate) "
                                      "when Megatron is importable",
    "scaled_masked_softmax_cuda": _SOFTMAX,
    "scaled_upper_triang_masked_softmax_cuda": _SOFTMAX,
    "scaled_softmax_cuda": _SOFTMAX,
}

# Modules devshim blocks off CUDA, read from the blocker's own table: importing one (or anything under it) raises
# ModuleNotFoundError with the reason. Megatron guards each import with a torch fallback.
@functools.cache
def blocked_modules() -> dict[str, str]:
    """Module -> why devshim blocks it: devshim's own table, read when first needed (it imports torch, which
    ``devshim --version`` and ``devshim check``'s argument parsing must not)."""
    from devshim_core.integrations.megatron import extension_modules

    return dict(extension_modules.BLOCKED)


def __getattr__(name: str) -> Any:
    if name == "BLOCKED":
        return blocked_modules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_SDPA = "use torch.nn.functional.scaled_dot_product_attention"
# What to use instead, for a blocked module or another CUDA-only package. A module matches itself and everything
# under it; the longest match wins.
ADVICE: dict[str, str] = {
    "transformer_engine": "Transformer Engine is CUDA-only; use Megatron's local (non-TE) layer specs and plain torch",
    "flash_attn": f"FlashAttention's kernels are CUDA-only; {_SDPA}",
    "xformers": f"xFormers' kernels are CUDA-only; {_SDPA}",
    "triton": "Triton compiles kernels for NVIDIA/AMD GPUs only; write the op in PyTorch",
    "cupy": "CuPy arrays live in CUDA memory; use torch tensors",
    "pynvml": "NVML queries NVIDIA's driver; use the torch.cuda memory and device queries, which are redirected",
    "bitsandbytes": "bitsandbytes' kernels are CUDA-only; use unquantized layers and a torch.optim optimizer",
    "apex": "apex's kernels are CUDA-only; use the torch equivalents",
    "apex.amp": "apex.amp is CUDA-only (and deprecated); use torch.autocast and torch.amp.GradScaler",
    "apex.parallel": "apex.parallel is CUDA-only; use torch's DistributedDataParallel and torch.nn.SyncBatchNorm",
    "apex.contrib": "apex.contrib's kernels are CUDA-only; replace them with their PyTorch equivalents",
    "apex.optimizers": "apex's fused optimizers are CUDA-only; use torch.optim or the DeepSpeed config's optimizer",
    "apex.normalization": "apex's fused norms are CUDA-only; use torch.nn.LayerNorm or torch.nn.RMSNorm",
    "apex.multi_tensor_apply": "apex's multi_tensor_applier is CUDA-only; use torch's _foreach_* ops",
    "amp_C": "apex's amp_C kernels are CUDA-only; use torch's _foreach_* ops and torch.nn.utils.clip_grad_norm_",
    "fused_layer_norm_cuda": "a CUDA extension; use torch.nn.functional.layer_norm",
    "fused_mix_prec_layer_norm_cuda": "a CUDA extension; use torch.nn.functional.layer_norm",
    "scaled_masked_softmax_cuda": "a CUDA extension; use torch.softmax on the masked scores",
    "scaled_upper_triang_masked_softmax_cuda": "a CUDA extension; use torch.softmax on the masked scores",
    "scaled_softmax_cuda": "a CUDA extension; use torch.softmax",
    "torch.cuda.jiterator": coverage.UNSERVED_CUDA["jiterator"],
}


@dataclass(frozen=True)
class ModuleRule:
    """What importing ``module`` does under devshim; ``key`` is the table entry that matched (``apex.amp`` for
    ``apex.amp.handle``), ``top`` the top-level name a blocked import is refused by."""

    key: str
    kind: Literal["provided", "blocked", "cuda_only"]
    advice: str

    @property
    def top(self) -> str:
        return self.key.partition(".")[0]


# an unguarded import of a blocked module raises; a guard whose except clause re-raises (or exits) has no fallback
BLOCKED_IMPORT_MESSAGE = "devshim blocks {top} off CUDA, so this import raises ModuleNotFoundError{reraised}; {advice}"
BLOCKED_RERAISED = " and the except clause at line {line} re-raises it (no fallback)"
RERAISED_MESSAGE = "{advice} (the except clause at line {line} re-raises the import error: no fallback)"
# a guard with a fallback: the blocked import raises and the script goes on without the module, as Megatron does
BLOCKED_FALLBACK_MESSAGE = ("devshim blocks {top} off CUDA: the import raises ModuleNotFoundError and the except "
                            "clause at line {line} runs instead")
# without Megatron devshim neither provides nor blocks: these imports are as for any CUDA-only package
NOT_PROVIDED_MESSAGE = ("devshim provides {module} only where Megatron is importable, and it is not here; install "
                        "megatron-core (or Megatron's checkout) where this runs")
# a package devshim does not block: if it is installed the import succeeds and its CUDA-only code runs
GUARDED_IMPORT_MESSAGE = "{why}; the import is guarded by an except clause, so check that the fallback does the job"
IMPORT_ERRORS: frozenset[str] = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})
EXITS: frozenset[str] = frozenset({"sys.exit", "os._exit", "exit", "quit"})  # in an except clause: no fallback

# torch.load(map_location='cuda' | 'cuda:N' | {...: 'cuda'}): served by the redirect's checkpoint locations
# (cuda_redirect/serialization.py maps CUDA storage locations to the selected device)
MAP_LOCATION_MESSAGE = "torch.load puts the checkpoint's tensors on {device}"

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


def module_rule(module: str) -> ModuleRule | None:
    """What importing ``module`` (or using a name under it) does under devshim, or ``None`` if nothing to say."""
    for prefix in _prefixes(module):
        if prefix in PROVIDED:
            return ModuleRule(prefix, "provided", PROVIDED[prefix])
    key = next((p for p in _prefixes(module) if p in ADVICE), None)
    top = module.partition(".")[0]
    if top in blocked_modules():
        return ModuleRule(key or top, "blocked", ADVICE[key] if key else blocked_modules()[top])
    return ModuleRule(key, "cuda_only", ADVICE[key]) if key else None


def import_rule(rule: ModuleRule, guard: tuple[int, bool] | None, megatron: bool = True) -> tuple[Category, str]:
    """The category and message of an import matching ``rule``; ``guard``: the innermost try block whose except
    clause catches the import error, as (the clause's line, whether it re-raises or exits), or ``None``;
    ``megatron``: whether Megatron is importable, so that devshim provides and blocks modules."""
    if not megatron and rule.kind != "cuda_only":
        advice = NOT_PROVIDED_MESSAGE.format(module=rule.key) if rule.kind == "provided" else rule.advice
        rule = ModuleRule(rule.key, "cuda_only", advice)
    if rule.kind == "provided":
        return "provided", rule.advice
    line, reraises = guard or (0, True)
    if rule.kind == "blocked":
        if not reraises:
            return "blocked", BLOCKED_FALLBACK_MESSAGE.format(top=rule.top, line=line)
        reraised = BLOCKED_RERAISED.format(line=line) if guard else ""
        return "unsupported", BLOCKED_IMPORT_MESSAGE.format(top=rule.top, reraised=reraised, advice=rule.advice)
    if not reraises:
        return "review", GUARDED_IMPORT_MESSAGE.format(why=rule.advice)
    return "unsupported", RERAISED_MESSAGE.format(advice=rule.advice, line=line) if guard else rule.advice


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
    # calls that raise off CUDA, under devshim too (the redirect refuses them, naming the call); ``memory.x`` keys
    # are torch.cuda.memory's
    for key in (".".join(path[:2]), head):
        if key in coverage.CUDA_ONLY_CALLS:
            return "unsupported", coverage.CUDA_ONLY_CALLS[key]
    name = ".".join(["torch.cuda", head, *rest[:1]])
    return "review", f"{name} is not redirected; check what it does without CUDA"


def review_prefix_rule(dotted: str) -> str | None:
    for prefix in _prefixes(dotted):
        if prefix in REVIEW_PREFIXES:
            return REVIEW_PREFIXES[prefix]
    return None
