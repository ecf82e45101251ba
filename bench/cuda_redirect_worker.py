"""One contender of ``bench/cuda_redirect.py``: times each case's call in this process and prints JSON.

``--contender plain`` never imports devshim (torch as installed); ``--contender redirect`` imports
``devshim_core.auto`` after torch and checks that it selected cpu_reference and applied the CUDA redirect.
Each case is one statement, timed by ``timeit`` (its compiled loop adds the same small cost to both
contenders): one untimed loop, then ``--loops`` loops of ``--calls`` calls; the figure is the fastest loop's
time divided by ``--calls`` (the minimum: on a shared machine the slower loops measure the other tenants).
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit

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


def _in_process(namespace: dict, calls: int, loops: int) -> dict[str, dict[str, float]]:
    """Each wrapped call against its original in this one process (``bench/cuda_redirect.py``'s second protocol):
    ``loops`` loops of each, alternating loop by loop (the wrapped one first in even loops) after one untimed loop
    of each; per case, the geometric mean of each one's loop times, per call."""
    import types

    namespace = {**namespace, "orig": types.SimpleNamespace(empty=torch.empty.__devshim_original__,
                                                            to=torch.Tensor.to.__devshim_original__)}
    timers = {case: (timeit.Timer(CASES[case][0], globals=namespace), timeit.Timer(UNWRAPPED[case], globals=namespace))
              for case in CASES}
    seconds: dict[str, tuple[list[float], list[float]]] = {case: ([], []) for case in CASES}
    for loop in range(loops + 1):
        for case, pair in timers.items():
            for i in (0, 1) if loop % 2 == 0 else (1, 0):
                elapsed = pair[i].timeit(calls)
                if loop:  # the first pass is warm-up
                    seconds[case][i].append(elapsed / calls)
    return {case: {"wrapped": statistics.geometric_mean(wrapped), "original": statistics.geometric_mean(original)}
            for case, (wrapped, original) in seconds.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contender", choices=("plain", "redirect"), required=True)
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--loops", type=int, default=5)
    p.add_argument("--in-process-loops", type=int, default=10)
    a = p.parse_args()
    before = {name: get() for name, get in NO_DEVICE.items()}
    report: dict[str, object] = {"contender": a.contender}
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
    if a.contender == "redirect":
        report["in_process"] = _in_process(namespace, a.calls, a.in_process_loops)
    report["devices"] = {case: str(eval(s[0 if a.contender == "redirect" else 1], namespace).device)
                         for case, s in CASES.items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
