"""What ``import devshim_core.auto`` adds to a training script's start-up.

Each contender is a fresh interpreter that times its own imports (interpreter start-up is the same for all
and left out): the peer imports torch and deepspeed; devshim's run puts ``import devshim_core.auto`` first,
as the docs recommend, so the cost includes discovery, selection, the device facade and installing the
DeepSpeed accelerator while deepspeed imports. A second devshim run imports it after deepspeed (the
re-binding path) and is reported for information. Sources are byte-compiled first, as an installed wheel is.
"""

from __future__ import annotations

import compileall
import os
import pathlib
import subprocess
import sys

from bench.common import Comparison, Note, Result

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMED = "import time; t = time.perf_counter(); {body}; print(time.perf_counter() - t)"
CONTENDERS = {
    "torch + deepspeed": "import torch, deepspeed",
    "devshim first": "import devshim_core.auto; import torch, deepspeed",
    "devshim after deepspeed": "import torch, deepspeed; import devshim_core.auto",
}


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_") and k != "DS_ACCELERATOR"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _once(body: str, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", TIMED.format(body=body)], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[Result]:
    for folder in ("devshim_core", "kernels", "plugins"):
        compileall.compile_dir(ROOT / folder, quiet=1)
    env = _clean_env()
    repeats = 2 if quick else 15
    best = dict.fromkeys(CONTENDERS, float("inf"))
    for _ in range(repeats):  # interleaved: a noisy moment hits every contender alike
        for name, body in CONTENDERS.items():
            best[name] = min(best[name], _once(body, env))
    base = best["torch + deepspeed"]
    first = best["devshim first"] - base
    after = best["devshim after deepspeed"] - base
    return [
        Comparison(group="import", case="import devshim_core.auto first", subject="devshim first",
                   subject_seconds=best["devshim first"], peer="import torch, deepspeed", peer_seconds=base,
                   max_ratio=(base + 0.050) / base, target="cost ≤ 50 ms over torch + deepspeed",
                   details={"cost_ms": first * 1e3, "repeats": repeats}),
        Note(group="import", name="cost of devshim_core.auto (devshim first)", value=first * 1e3, unit="ms",
             target="≤ 50 ms", met=first <= 0.050),
        Note(group="import", name="cost of devshim_core.auto (after deepspeed: re-binding)", value=after * 1e3,
             unit="ms"),
    ]
