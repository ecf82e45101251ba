"""What ``import devshim_core.auto`` adds to a training script's start-up.

Each sample is a fresh interpreter that imports torch first (a second of start-up every contender shares,
and the noisiest part of it, so it is left out of the timing), then times the rest: the peer times
``import deepspeed``; devshim's run times ``import devshim_core.auto`` and then ``import deepspeed``, so its
cost includes discovery, selection, the device facade and installing the accelerator while deepspeed
imports (where DeepSpeed's own accelerator auto-detection is skipped). Cost = devshim's total minus the
peer's, minimum over interleaved samples. A second devshim run imports it after deepspeed (the re-binding
path) and is reported for information. Sources are byte-compiled first, as an installed wheel's are.
"""

from __future__ import annotations

import compileall
import json
import pathlib
import subprocess
import sys

from bench.common import Comparison, Note, Result, environment_without_devshim

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLE = """
import json, time
import torch
marks = [time.perf_counter()]
for statement in {statements!r}:
    exec(statement)
    marks.append(time.perf_counter())
print(json.dumps([b - a for a, b in zip(marks, marks[1:])]))
"""
CONTENDERS = {
    "deepspeed alone": ["import deepspeed"],
    "devshim first": ["import devshim_core.auto", "import deepspeed"],
    "devshim after deepspeed": ["import deepspeed", "import devshim_core.auto"],
}


def _clean_env() -> dict[str, str]:
    env = environment_without_devshim()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _sample(statements: list[str], env: dict[str, str]) -> list[float]:
    out = subprocess.run([sys.executable, "-c", SAMPLE.format(statements=statements)], env=env, cwd=ROOT,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[Result]:
    for folder in ("devshim_core", "kernels", "plugins"):
        compileall.compile_dir(ROOT / folder, quiet=1)
    env = _clean_env()
    repeats = 1 if quick else 15
    best = {name: [float("inf")] * len(statements) for name, statements in CONTENDERS.items()}
    for _ in range(repeats):  # interleaved: a noisy moment hits every contender alike
        for name, statements in CONTENDERS.items():
            best[name] = [min(a, b) for a, b in zip(best[name], _sample(statements, env), strict=True)]
    peer = best["deepspeed alone"][0]
    first = sum(best["devshim first"]) - peer
    after = sum(best["devshim after deepspeed"]) - peer
    return [
        Comparison(group="import", case="import devshim_core.auto, then deepspeed (after torch)",
                   subject="devshim_core.auto + deepspeed", subject_seconds=sum(best["devshim first"]),
                   peer="import deepspeed", peer_seconds=peer, max_ratio=(peer + 0.050) / peer,
                   target="cost ≤ 50 ms over torch + deepspeed",
                   details={"cost_ms": first * 1e3, "auto_ms": best["devshim first"][0] * 1e3,
                            "deepspeed_after_devshim_ms": best["devshim first"][1] * 1e3, "repeats": repeats}),
        Note(group="import", name="cost of import devshim_core.auto (before deepspeed)", value=first * 1e3,
             unit="ms", target="≤ 50 ms", met=first <= 0.050),
        Note(group="import", name="cost of import devshim_core.auto (after deepspeed: re-binding)",
             value=after * 1e3, unit="ms"),
    ]
