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


# an op taking at least this share of a call's own (self) CPU time is one of the kernels that do its work
KERNEL_SHARE = 0.05


def kernels_run(call: Callable[[], object]) -> tuple[str, ...]:
    """The operators that do the work in one ``call``: profiled once (``torch.profiler``, CPU), the ops holding at
    least ``KERNEL_SHARE`` of the self CPU time, sorted by name. Two contenders with the same answer run the same
    kernels: timing one against the other compares a kernel with itself."""
    from torch.profiler import ProfilerActivity, profile

    call()  # once untimed: lazy set-up is not the work
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    if total <= 0:
        return ()
    return tuple(sorted(e.key for e in events if e.self_cpu_time_total >= KERNEL_SHARE * total))


def outputs_and_gradients(ours: Callable[[], Tensor], peer: Callable[[], Tensor], inputs: tuple[Tensor, ...],
                          grad: Tensor) -> list[tuple[str, Tensor, Tensor]]:
    """(what, devshim's, the peer's) for the output and each input's gradient, for the caller to compare."""
    ours_out, peer_out = ours(), peer()
    pairs = zip(torch.autograd.grad(ours_out, inputs, grad), torch.autograd.grad(peer_out, inputs, grad), strict=True)
    return [("output", ours_out, peer_out), *((f"grad of input {i}", a, b) for i, (a, b) in enumerate(pairs))]
