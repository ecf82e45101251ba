"""One contender of ``bench/cuda_redirect.py``: times each case's call in this process and prints JSON.

``--contender plain`` never imports devshim (torch as installed); ``--contender redirect`` imports
``devshim_core.auto`` after torch and checks that it selected cpu_reference and applied the CUDA redirect.
Each case is one statement, timed by ``timeit`` (its compiled loop adds the same small cost to both
contenders): one untimed loop, then ``--loops`` loops of ``--calls`` calls; the figure is the fastest loop's
time divided by ``--calls`` (the minimum: on a shared machine the slower loops measure the other tenants).

The redirect contender also times, in this one process (``bench/cuda_redirect.py``'s second protocol), each
wrapped factory / ``Tensor.to`` call against the original it forwards to (``UNWRAPPED``), and each ``torch.cuda.*``
call kind of ``TORCH_CUDA`` against the selected device's own function the redirect forwards it to: the device
facade's attribute of the same name (``session.device.<name>``, which is the plugin's own callable: its device
module's, its allocator's, or devshim's host streams for a device without streams, as cpu_reference is). Both are
reached the same way, through one attribute of a module bound to one name (``cuda.<name>(...)``, with
``cuda = torch.cuda``, against ``device.<name>(...)``, with ``device`` a module holding the facade's callables), so
the two statements differ only in the function they call. Per kind it reports whether ``torch.cuda.<name>`` *is*
that function (a bound method counts as the same when it binds the same function to the same object): such a
kind adds nothing by construction, and its row can only time the function against itself.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import timeit
import types

import torch

# case -> (the statement the redirect process times, the statement the plain process times)
CASES = {
    "factory, device named": ("torch.empty(64, device='cuda')", "torch.empty(64, device='cpu')"),
    "factory, no device": ("torch.empty(64)", "torch.empty(64)"),
    "Tensor.to, device named": ("x.to('cuda')", "x.to('cpu')"),
    "Tensor.to, dtype only": ("x.to(torch.float16)", "x.to(torch.float16)"),
}
# functions that take no device: the redirect must leave them the very objects torch defines
NO_DEVICE = {"torch.add": lambda: torch.add, "torch.matmul": lambda: torch.matmul,
             "Tensor.add": lambda: torch.Tensor.add, "torch.nn.functional.linear": lambda: torch.nn.functional.linear}


# case -> the redirected statement's unwrapped twin, run in the same process: the wrappers' originals
UNWRAPPED = {
    "factory, device named": "orig.empty(64, device='cpu')",
    "factory, no device": "orig.empty(64)",
    "Tensor.to, device named": "orig.to(x, 'cpu')",
    "Tensor.to, dtype only": "orig.to(x, torch.float16)",
}


# torch.cuda call kind -> (the name torch.cuda and the device facade share, its arguments, calls per loop as a divisor
# of --calls): the calls a training step makes (placement, checks, timing, stream waits, memory logging, the RNG
# state Megatron's checkpointing forks per layer). A divisor of 10 for the calls that take over 1 µs (a read of
# /proc for memory on cpu_reference, a tensor copy for the RNG state) keeps each loop near 10 ms.
TORCH_CUDA = {
    "torch.cuda.is_available()": ("is_available", "", 1),
    "torch.cuda.device_count()": ("device_count", "", 1),
    "torch.cuda.current_device()": ("current_device", "", 1),
    "torch.cuda.synchronize()": ("synchronize", "", 1),
    "torch.cuda.current_stream()": ("current_stream", "", 1),
    "torch.cuda.Event(enable_timing=True)": ("Event", "enable_timing=True", 1),
    "torch.cuda.memory_allocated()": ("memory_allocated", "", 10),
    "torch.cuda.max_memory_allocated()": ("max_memory_allocated", "", 10),
    "torch.cuda.get_rng_state()": ("get_rng_state", "", 10),
}


def _same(redirected: object, own: object) -> bool:
    """Whether the redirected ``torch.cuda`` attribute is the device's own function itself."""
    if redirected is own:
        return True
    return (inspect.ismethod(redirected) and inspect.ismethod(own) and redirected.__func__ is own.__func__
            and redirected.__self__ is own.__self__)


def _name(function: object) -> str:
    function = getattr(function, "__func__", function)
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', type(function).__qualname__)}"


def _alternating_loops(pairs: dict[str, tuple[timeit.Timer, timeit.Timer, int]],
                       loops: int) -> dict[str, dict[str, float]]:
    """``loops`` loops of each pair's two statements (``calls`` calls a loop), alternating loop by loop (the wrapped
    one first in even loops) after one untimed loop of each; per case, the geometric mean of each one's loop times,
    per call."""
    seconds: dict[str, tuple[list[float], list[float]]] = {case: ([], []) for case in pairs}
    for loop in range(loops + 1):
        for case, (wrapped, original, calls) in pairs.items():
            for i in (0, 1) if loop % 2 == 0 else (1, 0):
                elapsed = (wrapped, original)[i].timeit(calls)
                if loop:  # the first pass is warm-up
                    seconds[case][i].append(elapsed / calls)
    return {case: {"wrapped": statistics.geometric_mean(wrapped), "original": statistics.geometric_mean(original)}
            for case, (wrapped, original) in seconds.items()}


def _in_process(namespace: dict, calls: int, loops: int) -> dict[str, dict[str, float]]:
    """Each wrapped call against its original in this one process (``bench/cuda_redirect.py``'s second
    protocol)."""
    namespace = {**namespace, "orig": types.SimpleNamespace(empty=torch.empty.__devshim_original__,
                                                            to=torch.Tensor.to.__devshim_original__)}
    return _alternating_loops({case: (timeit.Timer(CASES[case][0], globals=namespace),
                                      timeit.Timer(UNWRAPPED[case], globals=namespace), calls) for case in CASES},
                              loops)


def _torch_cuda(facade: object, calls: int, loops: int) -> dict[str, dict[str, object]]:
    """Each ``torch.cuda.*`` kind of ``TORCH_CUDA`` against the device's own function, in this one process (the
    same protocol), with whether the two are one function and the device function's name."""
    device = types.ModuleType("device")  # what the redirect forwards to, reached as torch.cuda's functions are
    for name, _args, _divisor in TORCH_CUDA.values():
        setattr(device, name, getattr(facade, name))
    namespace = {"cuda": torch.cuda, "device": device}
    pairs = {kind: (timeit.Timer(f"cuda.{name}({args})", globals=namespace),
                    timeit.Timer(f"device.{name}({args})", globals=namespace), max(1, calls // divisor))
             for kind, (name, args, divisor) in TORCH_CUDA.items()}
    timed = _alternating_loops(pairs, loops)
    return {kind: {**timed[kind], "calls": pairs[kind][2], "peer_function": _name(getattr(device, name)),
                   "same_object": _same(getattr(torch.cuda, name), getattr(device, name))}
            for kind, (name, _args, _divisor) in TORCH_CUDA.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contender", choices=("plain", "redirect"), required=True)
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--loops", type=int, default=5)
    p.add_argument("--in-process-loops", type=int, default=10)
    a = p.parse_args()
    before = {name: get() for name, get in NO_DEVICE.items()}
    report: dict[str, object] = {"contender": a.contender}
    facade = None  # the redirect contender's device facade
    if a.contender == "redirect":
        import devshim_core.auto  # noqa: F401
        from devshim_core.session import current

        session = current()
        redirect = session.integrations.get("cuda-redirect", "") if session else ""
        if session is None or session.device.plugin != "cpu_reference" or not redirect.startswith("applied"):
            raise SystemExit(f"expected cpu_reference with the CUDA redirect applied, got "
                             f"{session.device.plugin if session else None}: {redirect!r}")
        if getattr(torch.empty, "__devshim_original__", None) is None:
            raise SystemExit("torch.empty is not wrapped: the redirect would not be measured")
        report["plugin"], report["cuda_redirect"] = session.device.plugin, redirect
        facade = session.device
    elif "devshim_core" in __import__("sys").modules:
        raise SystemExit("the plain contender imported devshim")
    report["untouched"] = {name: get() is before[name] for name, get in NO_DEVICE.items()}
    namespace = {"torch": torch, "x": torch.ones(64)}
    per_call: dict[str, float] = {}
    for case, statements in CASES.items():
        stmt = statements[0 if a.contender == "redirect" else 1]
        timer = timeit.Timer(stmt, globals=namespace)
        timer.timeit(a.calls)  # warm-up: first calls, caches (the redirect's memo of 'cuda')
        per_call[case] = min(timer.repeat(repeat=a.loops, number=a.calls)) / a.calls
    report["seconds_per_call"] = per_call
    if facade is not None:
        report["in_process"] = _in_process(namespace, a.calls, a.in_process_loops)
        report["torch_cuda"] = _torch_cuda(facade, a.calls, a.in_process_loops)
    report["devices"] = {case: str(eval(s[0 if a.contender == "redirect" else 1], namespace).device)
                         for case, s in CASES.items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
