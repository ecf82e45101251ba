"""Shape checks the kernels make on every call, without ``torch.broadcast_shapes``' cost (about 20 us a call: more
than a small kernel's arithmetic)."""

from __future__ import annotations

from collections.abc import Sequence


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without enlarging it (``torch.broadcast_shapes(shape, target) ==
    target``)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target), strict=False))
