"""The rules of ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_HIP_ALLOC_CONF`` on ROCm), checked before training starts.

torch parses the variable at the first allocation and stops there on a value it refuses, minutes into a job; this
refuses the same settings at activation. The syntax is ``key:value,key:value``, spaces ignored, and
``roundup_power2_divisions`` also takes a bracketed list (``[256:1,512:2,>:8]``). The keys checked are torch 2.4 to
2.13's, both spellings of the ROCm-renamed ones included; a key not listed here is left to torch (which stops on one it
does not know, "Unrecognized CachingAllocator option"), so that a key a newer torch adds is never refused by devshim.
"""

from __future__ import annotations

from collections.abc import Callable

from devshim_core.allocator_config import power_of_two, roundup_divisions, split_items

CUDA_ENV = "PYTORCH_CUDA_ALLOC_CONF"
HIP_ENV = "PYTORCH_HIP_ALLOC_CONF"
MIN_SPLIT_MB = 20  # torch's kLargeBuffer: max_split_size_mb and max_non_split_rounding_mb below it are refused
MAX_REGISTER_THREADS = 128

_BOOL = "True or False (capitalised)"
_KEYS: dict[str, str] = {
    "backend": "native or cudaMallocAsync",
    "max_split_size_mb": f"a size in MB of at least {MIN_SPLIT_MB}",
    "max_non_split_rounding_mb": f"a size in MB of at least {MIN_SPLIT_MB}",
    "large_segment_size_mb": "a size in MB",
    "garbage_collection_threshold": "a fraction strictly between 0 and 1",
    "roundup_power2_divisions": "a power of 2, or a list [size:divisions,...,>:divisions] of powers of 2 (0 disables)",
    "expandable_segments": _BOOL,
    "release_lock_on_cudamalloc": _BOOL,
    "release_lock_on_hipmalloc": _BOOL,
    "pinned_use_cuda_host_register": _BOOL,
    "pinned_use_hip_host_register": _BOOL,
    "pinned_num_register_threads": f"a power of 2 up to {MAX_REGISTER_THREADS}",
    "pinned_use_background_threads": _BOOL,
    "pinned_reserve_segment_size_mb": "a size in MB",
    "pinned_free_catch_all": _BOOL,
    "graph_capture_record_stream_reuse": _BOOL,
    "per_process_memory_fraction": "a fraction from 0 to 1",
    "throw_on_cudamalloc_oom": _BOOL,
}


def _is_int(value: str) -> bool:
    return value.isdigit()


def _fraction(value: str, *, bounds_allowed: bool) -> bool:
    """A number in (0, 1), or in [0, 1] when ``bounds_allowed``."""
    try:
        number = float(value)
    except ValueError:
        return False
    return 0.0 <= number <= 1.0 if bounds_allowed else 0.0 < number < 1.0


_CHECKS: dict[str, Callable[[str], bool]] = {
    "backend": lambda v: v in ("native", "cudaMallocAsync", "hipMallocAsync"),
    "max_split_size_mb": lambda v: _is_int(v) and int(v) >= MIN_SPLIT_MB,
    "max_non_split_rounding_mb": lambda v: _is_int(v) and int(v) >= MIN_SPLIT_MB,
    "large_segment_size_mb": _is_int,
    "garbage_collection_threshold": lambda v: _fraction(v, bounds_allowed=False),
    "roundup_power2_divisions": roundup_divisions,
    "pinned_num_register_threads": lambda v: power_of_two(v) and int(v) <= MAX_REGISTER_THREADS,
    "pinned_reserve_segment_size_mb": _is_int,
    "per_process_memory_fraction": lambda v: _fraction(v, bounds_allowed=True),
}


def config_env(rocm: bool) -> str:
    return HIP_ENV if rocm else CUDA_ENV


def parse_config(value: str) -> dict[str, str]:
    """``key:value,...`` as a dict; raises ``ValueError`` on a malformed item."""
    settings: dict[str, str] = {}
    for item in split_items(value.replace(" ", "")):
        key, sep, setting = item.partition(":")
        if not sep or not key or not setting:
            raise ValueError(f"{item!r} is not key:value (e.g. expandable_segments:True)")
        settings[key] = setting
    return settings


def validate_config(value: str) -> None:
    """Refuse what torch's caching allocator would refuse at its first allocation."""
    for key, setting in parse_config(value).items():
        if key not in _KEYS:
            continue  # torch's to judge: a newer torch's key must not be refused here
        check = _CHECKS.get(key, lambda v: v in ("True", "False"))
        if not check(setting):
            raise ValueError(f"{key}:{setting} is invalid: {key} takes {_KEYS[key]}")
