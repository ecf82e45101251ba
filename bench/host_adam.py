"""The host Adam step of ZeRO-Offload: devshim's kernel against torch.optim.AdamW(fused=True) and DeepSpeedCPUAdam.

One fp32 AdamW step over 20M and 100M params, alone and with a bf16 copy of the updated params (what offload
sends to the device). devshim writes that copy in the same pass as the fp32 master params; the peers step, then
``copy_`` the params into a bf16 tensor (a second pass over the fp32 params). All contenders update the same
tensors, in ``ROUNDS`` paired rounds of one step each (:mod:`bench.stats`); the peer of a row is whichever of the
two peers has the smaller geometric mean there. Also timed, not compared: devshim's PyTorch path
(``DEVSHIM_KERNELS_NATIVE=0``). Every row is a kernel timed on its own: what ZeRO-Offload's step adds around it
is ``offload_step``'s to measure.

Measured in a separate process, so that the peer is DeepSpeed's own op (``DS_ACCELERATOR=cpu``, devshim not
active) whatever the calling process has imported, and so that DeepSpeed's JIT build is timed on its own. Also
measured there: an in-place ``mul_`` over a buffer of the params' size, the machine's streaming bandwidth, which
a memory-bound step can only approach. Bytes per step count each tensor read or written once (the minimum):
28 per param (read param, grad and both moments, write back three), +2 for devshim's copy, +6 for a peer's
second pass (read the fp32 param again, write the copy).

``run(quick=True)`` is the smoke test: tiny sizes, in this process, no DeepSpeed, nothing compiled.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.common import Comparison, Note, Result
from bench.stats import interleaved_rounds

GROUP = "host_adam"
SIZES = {"20M": 20_000_000, "100M": 100_000_000}
QUICK_SIZES = {"100k": 100_003}
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
# bytes per param and step: read param, grad, exp_avg, exp_avg_sq (4 each), write param, exp_avg, exp_avg_sq
FP32_STEP_BYTES = 28
COPY_BYTES = {"one pass": 2, "second pass": 4 + 2}  # write the bf16 copy / read the fp32 param again, then write
MUL_BYTES = 8  # mul_: read and write each fp32 element
ROUNDS = 10
DEVSHIM_TORCH_PATH = "devshim (torch path, DEVSHIM_KERNELS_NATIVE=0)"
TORCH_FUSED = "torch.optim.AdamW(fused=True)"
DEEPSPEED = "DeepSpeedCPUAdam"


def _contenders(n: int, copy: bool, deepspeed_adam: Any | None) -> dict[str, Callable[[], object]]:
    """One step of each contender. All of them update the same tensors (torch.optim's param and state, and one
    bf16 copy): with 7 streams of 80-400 MB, where each array lands in physical memory moves a step by several
    percent, so separate tensors would measure their placement as much as the kernels. At these sizes no
    contender finds anything of the previous one's in a cache."""
    import torch
    from devshim_kernels import adam

    lr, betas, eps, weight_decay = HYPER["lr"], (HYPER["beta1"], HYPER["beta2"]), HYPER["eps"], HYPER["weight_decay"]
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n) * 1e-2
    fused = torch.optim.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    fused.step()  # creates the state every contender updates
    p, grad = param.detach(), param.grad
    m, v = fused.state[param]["exp_avg"], fused.state[param]["exp_avg_sq"]
    p_copy = torch.empty(n, dtype=torch.bfloat16) if copy else None
    steps = {"devshim": 0}

    def devshim() -> None:
        steps["devshim"] += 1
        adam.host_adam_step(p, grad, m, v, step=steps["devshim"], **HYPER, param_copy=p_copy)

    def devshim_torch_path() -> None:
        before = os.environ.get(adam.NATIVE_SWITCH)
        os.environ[adam.NATIVE_SWITCH] = "0"
        try:
            devshim()
        finally:
            if before is None:
                del os.environ[adam.NATIVE_SWITCH]
            else:
                os.environ[adam.NATIVE_SWITCH] = before

    def optimizer_step(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
        def step() -> None:
            optimizer.step()
            if p_copy is not None:
                p_copy.copy_(p)  # the peer's second pass: read the fp32 params again, write the copy

        return step

    fns: dict[str, Callable[[], object]] = {"devshim": devshim, DEVSHIM_TORCH_PATH: devshim_torch_path,
                                            TORCH_FUSED: optimizer_step(fused)}
    if deepspeed_adam is not None:
        ds = deepspeed_adam([param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True)
        ds.step()  # creates its state, then replaced by the shared one
        ds.state[param]["exp_avg"], ds.state[param]["exp_avg_sq"] = m, v
        fns[DEEPSPEED] = optimizer_step(ds)
    buffer = torch.randn(n)
    fns["mul_"] = lambda: buffer.mul_(1.0)
    return fns


def _deepspeed_peer() -> tuple[Any | None, dict[str, Any]]:
    """DeepSpeed's CPU Adam from its own CPU op builder, built (or loaded from $TORCH_EXTENSIONS_DIR) and timed."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    info: dict[str, Any] = {}
    try:
        import torch.utils.cpp_extension as cpp_extension
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builder = CPUAdamBuilder()
        try:  # where torch's JIT puts it ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions): built before?
            build_dir = pathlib.Path(cpp_extension._get_build_directory(builder.name, verbose=False))
            info["cached"], info["build_dir"] = any(build_dir.glob("*.so")), str(build_dir)
        except Exception:  # a private torch helper: if it changes, only this detail is lost
            info["cached"], info["build_dir"] = None, "an unknown directory"
        start = time.perf_counter()
        builder.load()
        info["build_seconds"] = time.perf_counter() - start
        info["builder"] = f"{type(builder).__module__}.{type(builder).__name__}"
        return DeepSpeedCPUAdam, info
    except Exception as error:  # no compiler, no ninja, ...: report it, measure the rest
        info["error"] = f"{type(error).__name__}: {error}"
        return None, info


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def measure(quick: bool = False) -> dict[str, Any]:
    """Raw timings of every configuration (seconds), the bytes each contender moves, and how the run went."""
    import torch
    from devshim_kernels import adam

    deepspeed_adam, deepspeed_info = (None, {"skipped": "quick mode"}) if quick else _deepspeed_peer()
    raw: dict[str, Any] = {"quick": quick, "implementation": adam.implementation(), "threads": torch.get_num_threads(),
                           "deepspeed": deepspeed_info, "devshim_core_imported": "devshim_core" in sys.modules,
                           "versions": {"torch": torch.__version__, "deepspeed": _version("deepspeed")},
                           "cases": []}
    rounds = 3 if quick else ROUNDS
    for label, n in (QUICK_SIZES if quick else SIZES).items():
        for copy in (False, True):
            fns = _contenders(n, copy, deepspeed_adam)
            seconds = interleaved_rounds(fns, rounds=rounds, warmup=1 if quick else 2)
            raw["cases"].append({"label": label, "n": n, "copy": copy, "seconds": seconds})
            del fns
    return raw


def _measure_in_subprocess() -> dict[str, Any]:
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_") or k == "DEVSHIM_KERNELS_NATIVE"}
    env["DS_ACCELERATOR"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "raw.json"
        done = subprocess.run([sys.executable, "-m", "bench.host_adam", str(out)], cwd=root, env=env,
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"host_adam worker failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def results(raw: dict[str, Any]) -> list[Result]:
    out: list[Result] = []
    ds = raw["deepspeed"]
    if "build_seconds" in ds:
        what = {True: "load of a cached build", False: "JIT build", None: "JIT build or load"}[ds["cached"]]
        out.append(Note(GROUP, f"{DEEPSPEED} op ({ds['builder']}): {what}, in {ds['build_dir']}",
                        ds["build_seconds"], "s"))
    elif "error" in ds:
        out.append(Note(GROUP, f"{DEEPSPEED} unavailable: {ds['error']}", math.nan, "s"))
    for case in raw["cases"]:
        n, copy, rounds = case["n"], case["copy"], dict(case["seconds"])
        seconds = {k: statistics.geometric_mean(v) for k, v in rounds.items()}
        name = f"{case['label']} fp32" + (" + bf16 copy" if copy else "")
        peers = {k: s for k, s in seconds.items() if k in (TORCH_FUSED, DEEPSPEED)}
        peer = min(peers, key=peers.__getitem__)  # the harder of the two
        ours_bytes = n * (FP32_STEP_BYTES + (COPY_BYTES["one pass"] if copy else 0))
        peer_bytes = n * (FP32_STEP_BYTES + (COPY_BYTES["second pass"] if copy else 0))
        mul_gbps = MUL_BYTES * n / seconds["mul_"] / 1e9
        ours_gbps = ours_bytes / seconds["devshim"] / 1e9
        details = {
            "params": n, "threads": raw["threads"], "implementation": raw["implementation"],
            "devshim_bytes_per_step": ours_bytes, "peer_bytes_per_step": peer_bytes,
            "devshim_GBps": round(ours_gbps, 2), "peer_GBps": round(peer_bytes / seconds[peer] / 1e9, 2),
            "mul_GBps": round(mul_gbps, 2),
            "ms_per_round": {k: [round(s * 1e3, 3) for s in v] for k, v in rounds.items()},
            "devshim_core_imported_by_the_worker": raw["devshim_core_imported"], "versions": raw["versions"],
        }
        if copy:
            max_ratio, target = 0.999, "strictly better than the peer's two passes (fp32 master + bf16 copy, one pass)"
        else:
            max_ratio, target = 1 / 0.95, "≥ 0.95× the faster peer's speed"
        out.append(Comparison(GROUP, name, f"devshim ({raw['implementation']})", rounds["devshim"], peer,
                              rounds[peer], max_ratio, target, details, kernel_only=True))
        if not raw["quick"]:  # tiny tensors live in the caches: no measure of memory bandwidth
            # the byte model counts each tensor once: a floor, so a figure near or above 100% says the step is as
            # memory-bound as mul_, not that it beats the machine; informational for that reason
            out.append(Note(GROUP, f"{name}: devshim's bytes per step (byte model) over its time, as % of an in-place "
                            f"mul_'s bandwidth ({ours_gbps:.1f} of {mul_gbps:.1f} GB/s)",
                            round(100 * ours_gbps / mul_gbps, 1), "%"))
    return out


def run(quick: bool = False) -> list[Result]:
    return results(measure(quick=True) if quick else _measure_in_subprocess())


if __name__ == "__main__":  # the worker: python -m bench.host_adam OUT.json
    pathlib.Path(sys.argv[1]).write_text(json.dumps(measure(quick=False)))
