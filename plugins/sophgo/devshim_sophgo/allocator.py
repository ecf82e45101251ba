"""The rules of ``PYTORCH_TPU_ALLOC_CONF``, checked before training starts rather than at the first allocation.

Sophgo documents the variable but not its keys; devshim accepts the caching-allocator keys PyTorch's own
allocators read, with the values PyTorch's parser accepts for them (``roundup_power2_divisions`` also in its
list form, ``[64:8,256:4,>:1]``), and refuses malformed settings and the one combination every such allocator
refuses.
"""

from __future__ import annotations

from devshim_core.allocator_config import roundup_divisions, split_items

CONFIG_ENV = "PYTORCH_TPU_ALLOC_CONF"
_KEYS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions")
KEYS = _KEYS  # what a PYTORCH_CUDA_ALLOC_CONF may carry over (the plugin's devshim_environment_map)


def _fraction(text: str) -> bool:
    try:
        return 0.0 < float(text) < 1.0
    except ValueError:
        return False


_VALUES = {
    "expandable_segments": (lambda v: v in ("True", "False"), "True or False"),
    "max_split_size_mb": (lambda v: v.isdigit() and int(v) > 20, "a size in MB greater than 20"),
    "garbage_collection_threshold": (_fraction, "a fraction strictly between 0 and 1"),
    "roundup_power2_divisions": (roundup_divisions, "a power of 2, or a list such as [64:8,256:4,>:1] of power-of-2 "
                                           "sizes in MB (> for the rest) to powers of 2 (or 0)"),
}


def validate_config(value: str) -> None:
    settings: dict[str, str] = {}
    for item in split_items(value):
        key, sep, setting = item.partition(":")
        if not sep or not setting.strip():
            raise ValueError(f"{item!r} is not key:value (e.g. max_split_size_mb:128)")
        if key.strip() not in _KEYS:
            raise ValueError(f"unknown key {key.strip()!r}; expected one of {', '.join(_KEYS)}")
        settings[key.strip()] = setting.strip()
    for key, setting in settings.items():
        valid, takes = _VALUES[key]
        if not valid(setting):
            raise ValueError(f"{key}:{setting} is invalid: {key} takes {takes}")
    if settings.get("expandable_segments") == "True" and "max_split_size_mb" in settings:
        raise ValueError("expandable_segments:True cannot be combined with max_split_size_mb; drop one of them")
