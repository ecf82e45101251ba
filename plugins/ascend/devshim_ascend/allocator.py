"""The rules of ``PYTORCH_NPU_ALLOC_CONF``, checked before training starts rather than at the first allocation."""

from __future__ import annotations

CONFIG_ENV = "PYTORCH_NPU_ALLOC_CONF"
# the keys torch_npu's caching allocator reads, with what each takes
_KEYS = {
    "expandable_segments": "True or False",
    "max_split_size_mb": "a size in MB greater than 20",
    "garbage_collection_threshold": "a fraction strictly between 0 and 1",
    "base_addr_aligned_kb": "an alignment in KB, an integer from 0 to 16 (16 by default; 0 means 512 bytes)",
    "page_size": "'1g' for huge pages",
}
KEYS = tuple(_KEYS)  # what a PYTORCH_CUDA_ALLOC_CONF may carry over (devshim_ascend.environment)


def parse_config(value: str) -> dict[str, str]:
    settings: dict[str, str] = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        key, sep, setting = item.partition(":")
        key, setting = key.strip(), setting.strip()
        if not sep or not setting:
            raise ValueError(f"{item!r} is not key:value (e.g. expandable_segments:True)")
        if key not in _KEYS:
            raise ValueError(f"unknown key {key!r}; torch_npu reads {', '.join(sorted(_KEYS))}")
        settings[key] = setting
    return settings


def validate_config(value: str) -> None:
    """Refuse what torch_npu would refuse at its first allocation, or silently ignore."""
    settings = parse_config(value)
    checks = {
        "expandable_segments": lambda v: v in ("True", "False"),
        "max_split_size_mb": lambda v: v.isdigit() and int(v) > 20,
        "garbage_collection_threshold": lambda v: _fraction(v),
        "base_addr_aligned_kb": lambda v: v.isdigit() and int(v) <= 16,
        "page_size": lambda v: v == "1g",  # torch_npu compares exactly: "1G" is refused
    }
    for key, setting in settings.items():
        if not checks[key](setting):
            raise ValueError(f"{key}:{setting} is invalid: {key} takes {_KEYS[key]}")
    if settings.get("expandable_segments") == "True":
        clashing = [k for k in ("max_split_size_mb", "garbage_collection_threshold") if k in settings]
        if clashing:
            raise ValueError(f"expandable_segments:True cannot be combined with {' or '.join(clashing)} "
                             "(torch_npu refuses the combination); drop one of them")


def _fraction(value: str) -> bool:
    try:
        return 0.0 < float(value) < 1.0
    except ValueError:
        return False
