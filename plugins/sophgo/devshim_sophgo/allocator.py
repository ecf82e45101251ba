"""The rules of ``PYTORCH_TPU_ALLOC_CONF``, checked before training starts rather than at the first allocation.

Sophgo documents the variable but not its keys; devshim accepts the caching-allocator keys PyTorch's own
allocators read and refuses malformed settings and the one combination every such allocator refuses.
"""

from __future__ import annotations

CONFIG_ENV = "PYTORCH_TPU_ALLOC_CONF"
_KEYS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions")


def validate_config(value: str) -> None:
    settings: dict[str, str] = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        key, sep, setting = item.partition(":")
        if not sep or not setting.strip():
            raise ValueError(f"{item!r} is not key:value (e.g. max_split_size_mb:128)")
        if key.strip() not in _KEYS:
            raise ValueError(f"unknown key {key.strip()!r}; expected one of {', '.join(_KEYS)}")
        settings[key.strip()] = setting.strip()
    if "max_split_size_mb" in settings and not (settings["max_split_size_mb"].isdigit()
                                                and int(settings["max_split_size_mb"]) > 20):
        raise ValueError("max_split_size_mb takes a size in MB greater than 20")
    if settings.get("expandable_segments") == "True" and "max_split_size_mb" in settings:
        raise ValueError("expandable_segments:True cannot be combined with max_split_size_mb; drop one of them")
