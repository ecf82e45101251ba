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
# ... and once it is one for any contender, any other contender spending this share on it runs it too: an op near
# KERNEL_SHARE (a fill_ at 4-12% of either side of SDPA against SDPA, as the machine's load moves it) must not make
# two contenders that run the same kernels look different
ALSO_RUN_SHARE = 0.01


def kernel_shares(call: Callable[[], object]) -> dict[str, float]:
    """Each ``aten::`` operator's share of the self CPU time of one ``call``, profiled once (``torch.profiler``,
    CPU) after one untimed call (lazy set-up is not the work)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    return {e.key: e.self_cpu_time_total / total for e in events} if total > 0 else {}


def kernels_run(call: Callable[[], object]) -> tuple[str, ...]:
    """The operators that do the work in one ``call``: those holding at least ``KERNEL_SHARE`` of its self CPU
    time, sorted by name. For contenders to be compared, use :func:`kernels_of`, which is robust to an op near
    the threshold."""
    return tuple(sorted(op for op, share in kernel_shares(call).items() if share >= KERNEL_SHARE))


def kernels_of(calls: dict[str, Callable[[], object]]) -> dict[str, tuple[str, ...]]:
    """Per contender, the operators that do its work, decided together: an op is a working kernel if it holds
    ``KERNEL_SHARE`` of some contender's self CPU time, and each contender's answer lists the working kernels it
    spends at least ``ALSO_RUN_SHARE`` on. Two contenders with the same answer run the same kernels: timing one
    against the other compares a kernel with itself; a contender with a working kernel of its own (a layout copy
    that takes 5% of its time) does other work."""
    shares = {name: kernel_shares(call) for name, call in calls.items()}
    working = {op for found in shares.values() for op, share in found.items() if share >= KERNEL_SHARE}
    return {name: tuple(sorted(op for op in working if found.get(op, 0.0) >= ALSO_RUN_SHARE))
            for name, found in shares.items()}


def outputs_and_gradients(ours: Callable[[], Tensor], peer: Callable[[], Tensor], inputs: tuple[Tensor, ...],
                          grad: Tensor) -> list[tuple[str, Tensor, Tensor]]:
    """(what, devshim's, the peer's) for the output and each input's gradient, for the caller to compare."""
    ours_out, peer_out = ours(), peer()
    pairs = zip(torch.autograd.grad(ours_out, inputs, grad), torch.autograd.grad(peer_out, inputs, grad), strict=True)
    return [("output", ours_out, peer_out), *((f"grad of input {i}", a, b) for i, (a, b) in enumerate(pairs))]
