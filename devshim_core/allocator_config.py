"""The syntax of PyTorch's caching-allocator settings (``PYTORCH_CUDA_ALLOC_CONF`` and the vendors' copies of it:
``PYTORCH_NPU_ALLOC_CONF``, ``PYTORCH_TPU_ALLOC_CONF``), for the plugins' ``AllocatorSpec.validate_config``.

Only the syntax every such allocator shares lives here; which keys a vendor's allocator reads, and what it accepts for
them, stay in its plugin.
"""

from __future__ import annotations


def split_items(value: str) -> list[str]:
    """The comma-separated ``key:value`` items, stripped and non-empty; a bracketed list stays one value
    (``roundup_power2_divisions:[64:8,>:1]``). Raises ``ValueError`` on unbalanced brackets."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in value:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{value!r} closes a ']' it never opened")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError(f"{value!r} opens a '[' it never closes")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def power_of_two(text: str, zero: bool = False) -> bool:
    """Whether ``text`` is a power of two written in decimal (or 0, when ``zero``)."""
    if not text.isdigit():
        return False
    number = int(text)
    return (number == 0 and zero) or (number > 0 and number & (number - 1) == 0)


def roundup_divisions(text: str) -> bool:
    """PyTorch's ``roundup_power2_divisions``: a power of two, or ``[interval:divisions,...]`` with power-of-two
    intervals (``>`` for the rest) and divisions that are powers of two or 0."""
    if not (text.startswith("[") and text.endswith("]")):
        return power_of_two(text)
    entries = [entry.strip() for entry in text[1:-1].split(",")]
    for entry in entries:
        interval, sep, divisions = (part.strip() for part in entry.partition(":"))
        if not sep or not (interval == ">" or power_of_two(interval)) or not power_of_two(divisions, zero=True):
            return False
    return bool(entries)
