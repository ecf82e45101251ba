"""What the kernel benchmarks share: a contender's two timed calls, and the pairs that show two contenders compute
the same thing (checked before timing: a ratio against a peer doing other work would be worthless)."""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensor = torch.Tensor


def forward_only(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """``fn`` under ``no_grad``: the forward as inference runs it, with nothing saved for a backward."""
    def forward() -> Tensor:
        with torch.no_grad():
            return fn()
    return forward


def forward_backward(fn: Callable[[], Tensor], inputs: tuple[Tensor, ...], grad: Tensor) -> Callable[[], object]:
    """``fn`` and its backward to ``inputs`` with the upstream gradient ``grad`` (``autograd.grad``, so no
    accumulation into ``.grad``)."""
    return lambda: torch.autograd.grad(fn(), inputs, grad)


def outputs_and_gradients(ours: Callable[[], Tensor], peer: Callable[[], Tensor], inputs: tuple[Tensor, ...],
                          grad: Tensor) -> list[tuple[str, Tensor, Tensor]]:
    """(what, devshim's, the peer's) for the output and each input's gradient, for the caller to compare."""
    ours_out, peer_out = ours(), peer()
    pairs = zip(torch.autograd.grad(ours_out, inputs, grad), torch.autograd.grad(peer_out, inputs, grad), strict=True)
    return [("output", ours_out, peer_out), *((f"grad of input {i}", a, b) for i, (a, b) in enumerate(pairs))]
