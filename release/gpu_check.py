"""The checks ``release/gpu_check.sh`` runs on a machine with an NVIDIA GPU, and the results it writes.

Run by that script with the venv it set up (``--python``); importable without torch, so that it can also write the
results of a run that found no GPU (``--skip-reason``). Parts, each with its own time limit, each skipped (saying
why) when what it needs is absent:

- ``probe``: torch, its CUDA runtime and devices; ``devshim info --json`` must select the ``cuda`` plugin;
- ``kit``: the conformance kit, ``pytest --devshim-plugin=cuda`` (its 2-rank jobs skip on a 1-GPU machine);
- ``demo`` and ``demo_facade``: ``make demo``'s run on one GPU: ``examples/train_gpt.py``, ZeRO-2, through the
  ``deepspeed`` launcher with ``DEVSHIM_AUTO=1``; devshim standing aside (DeepSpeed's CUDA accelerator), then with
  ``DEVSHIM_CUDA_FACADE=1`` (devshim's accelerator and the plugin's fused Adam);
- ``overhead``: one GPU, DeepSpeed ZeRO-2, the same script with and without ``import devshim_core.auto``, in paired
  rounds of one launch each, the order alternating; each launch's figure is its median step time after a warm-up,
  judged by the geometric mean of the per-round ratios with its bootstrap 95% interval (``bench.stats``) against the
  target of at most 1.01x.

Writes ``gpu-check.json`` and ``gpu-check.txt`` into ``--out`` (logs under ``logs/``). Exit status: 0 every part ran
and passed (the overhead verdict met or inconclusive), 1 a part failed (or the overhead target was missed), 2 nothing
failed but a part was skipped.

    python release/gpu_check.py --out DIR --python VENV/bin/python [--install TEXT] [--dry-run]
    python release/gpu_check.py --out DIR --skip-reason TEXT
    python release/gpu_check.py link-sources --venv VENV
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.stats import alternating, paired_ratio, verdict  # noqa: E402  (stdlib only)

PLUGIN = "cuda"
SCRIPT = ROOT / "examples" / "train_gpt.py"
TARGET = 1.01  # devshim's import may cost at most 1% of a ZeRO-2 step where it stands aside
ROUNDS = int(os.environ.get("GPU_CHECK_ROUNDS", "6"))
STEPS = int(os.environ.get("GPU_CHECK_STEPS", "40"))
WARMUP = 10
DEMO_STEPS = 30
# big enough that a step is GPU work, small enough that a launch takes seconds
MODEL = ["--hidden", "512", "--layers", "4", "--heads", "8", "--seq", "256", "--micro-batch", "8", "--vocab", "512"]
TIMEOUTS = {"probe": 180, "kit": int(os.environ.get("GPU_CHECK_KIT_TIMEOUT", "420")), "demo": 300, "launch": 240}
# what the venv holds when pip cannot install it: each source directory and the entry points pip would declare
SOURCES = {
    ".": {"pytest11": {"devshim_core.testing": "devshim_core.testing"},
          "console_scripts": {"devshim": "devshim_core.cli:main"}},
    "kernels": {},
    "plugins/cpu_reference": {"devshim": {"cpu_reference": "devshim_cpu_reference"}},
    "plugins/cuda": {"devshim": {"cuda": "devshim_cuda"}},
}


@dataclass
class Part:
    name: str
    status: str  # passed, failed, skipped
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


class Skip(Exception):
    """A part cannot run here; the message says why."""


class Fail(Exception):
    """A part ran and found something wrong; the message says what."""


# -- helpers ---------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without devshim's switches, DeepSpeed's accelerator choice or PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DEVSHIM_") and k not in ("DS_ACCELERATOR", "PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return {**env, **extra}


def run(command: list[str], log: Path, *, env: dict[str, str], timeout: float, cwd: Path) -> tuple[int, str]:
    """Run ``command``, write its output to ``log``; rc 124 when it ran past ``timeout``."""
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        rc, output = done.returncode, done.stdout + ("\n--- stderr ---\n" + done.stderr if done.stderr else "")
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        rc, output = 124, f"{out}\n(timed out after {timeout:.0f} s)"
    log.write_text(f"$ {shlex.join(command)}\n(cwd {cwd}, {time.perf_counter() - started:.1f} s, rc {rc})\n{output}")
    return rc, output


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def importable(python: str, module: str, out: Path) -> bool:
    rc, _ = run([python, "-c", f"import {module}"], out / "logs" / f"import-{module}.log", env=clean_env(),
                timeout=120, cwd=out)
    return rc == 0


# -- parts -----------------------------------------------------------------------------------------------------------

PROBE = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
         "'hip': getattr(torch.version, 'hip', None), 'devices': torch.cuda.device_count() "
         "if torch.cuda.is_available() else 0, 'name': torch.cuda.get_device_name(0) "
         "if torch.cuda.is_available() else None}))")


def probe(python: str, out: Path) -> Part:
    rc, output = run([python, "-c", PROBE], out / "logs" / "torch.log", env=clean_env(), timeout=TIMEOUTS["probe"],
                     cwd=out)
    if rc != 0:
        raise Skip(f"torch does not import or answer: {tail(output, 3)}")
    torch_facts = json.loads(output.splitlines()[0])
    if not torch_facts["devices"]:
        raise Skip(f"torch {torch_facts['torch']} sees no GPU")
    rc, output = run([python, "-m", "devshim_core", "info", "--json"], out / "logs" / "devshim-info.log",
                     env=clean_env(), timeout=TIMEOUTS["probe"], cwd=out)
    if rc != 0:
        raise Fail(f"devshim info --json exited {rc}: {tail(output, 5)}")
    info = json.loads(output[:output.index("\n--- stderr ---")] if "\n--- stderr ---" in output else output)
    (out / "devshim-info.json").write_text(json.dumps(info, indent=2))
    data = {"torch": torch_facts, "selected": info.get("selected"), "reason": info.get("reason"),
            "runtime": (info.get("host") or {}).get("runtime")}
    detail = (f"torch {torch_facts['torch']}, CUDA {torch_facts['cuda']}, {torch_facts['devices']} x "
              f"{torch_facts['name']}; devshim selected {info.get('selected')} ({info.get('reason')})")
    if info.get("selected") != PLUGIN:
        raise Fail(detail + f"; expected {PLUGIN}")
    return Part("probe", "passed", detail, data=data)


def kit(python: str, out: Path) -> Part:
    if not importable(python, "pytest", out):
        raise Skip("pytest is not installed in the venv's Python (pip install pytest, offline: a wheel)")
    report, scratch = out / "kit.xml", Path(tempfile.mkdtemp(prefix="devshim-kit-"))
    # -p: the kit's plugin even where pip could not register its pytest11 entry point (source links)
    command = [python, "-m", "pytest", "-p", "devshim_core.testing", "--noconftest", "-p", "no:cacheprovider", "-q",
               "-rs", f"--devshim-plugin={PLUGIN}", f"--junitxml={report}"]
    try:
        rc, output = run(command, out / "logs" / "kit.log", env=clean_env(TORCH_EXTENSIONS_DIR=str(scratch / "ext")),
                         timeout=TIMEOUTS["kit"], cwd=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if rc == 124:
        raise Fail(f"the kit did not finish in {TIMEOUTS['kit']} s (logs/kit.log): {tail(output, 5)}")
    if not report.is_file():
        raise Fail(f"pytest exited {rc} and wrote no report: {tail(output)}")
    counts = junit_counts(report)
    detail = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
              + (f"; failed: {', '.join(counts['failures'][:8])}" if counts["failures"] else "")
              + (f"; skips: {' | '.join(counts['skip_reasons'])}" if counts["skip_reasons"] else ""))
    if rc != 0 or counts["failed"]:
        raise Fail(detail)
    return Part("kit", "passed", detail, data=counts)


def junit_counts(report: Path) -> dict[str, Any]:
    """Passed, failed (errors included), skipped test cases of a junit XML report, with the skip reasons."""
    root = ElementTree.parse(report).getroot()
    cases = list(root.iter("testcase"))
    failures = [f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}" for c in cases
                if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c.find("skipped") for c in cases if c.find("skipped") is not None]
    reasons = sorted({(s.get("message") or "").removeprefix("Skipped: ") for s in skipped if s is not None})
    return {"passed": len(cases) - len(failures) - len(skipped), "failed": len(failures), "skipped": len(skipped),
            "failures": failures, "skip_reasons": reasons}


def demo(python: str, out: Path, extensions: Path, *, facade: bool) -> Part:
    name = "demo_facade" if facade else "demo"
    if not importable(python, "deepspeed", out):
        raise Skip("DeepSpeed is not installed in the machine's Python (the demo and the overhead runs need it)")
    report_path = out / f"{name}-report.json"
    env = clean_env(DEVSHIM_AUTO="1", OMP_NUM_THREADS="4", TORCH_EXTENSIONS_DIR=str(extensions),
                    PATH=f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if facade:
        env["DEVSHIM_CUDA_FACADE"] = "1"
    command = [python, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()),
               str(SCRIPT), "--zero-stage", "2", "--steps", str(DEMO_STEPS), "--report", str(report_path)]
    rc, output = run(command, out / "logs" / f"{name}.log", env=env, timeout=TIMEOUTS["demo"], cwd=ROOT)
    if rc != 0 or not report_path.is_file():
        jit = " (DeepSpeed's own CUDA ops JIT-compile on first use: this needs nvcc and ninja)" \
            if not facade and ("ninja" in output.lower() or "nvcc" in output.lower()) else ""
        raise Fail(f"the demo exited {rc}{jit}: {tail(output)}")
    report = json.loads(report_path.read_text())
    rank = report["ranks"][0]
    accelerator = "DevshimAccelerator" if facade else "CUDA_Accelerator"
    losses = report["losses"]
    data = {k: rank.get(k) for k in ("plugin", "accelerator", "param_devices", "deepspeed_integration",
                                     "basic_optimizer", "fused_op")}
    data.update(losses=losses, tokens_per_s=report.get("tokens_per_s"))
    detail = (f"{report['rank_count']} rank, plugin {rank['plugin']}, {rank['accelerator']}, params on "
              f"{rank['param_devices']}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"{report.get('tokens_per_s', 0):.0f} tokens/s")
    problems = []
    if report["rank_count"] != 1 or rank["plugin"] != PLUGIN or rank["accelerator"] != accelerator:
        problems.append(f"expected 1 rank on plugin {PLUGIN} with {accelerator}")
    if rank["param_devices"] != ["cuda:0"]:
        problems.append("expected the parameters on cuda:0")
    if report["optimizer_steps"] != DEMO_STEPS or not all(math.isfinite(x) for x in losses) or losses[-1] >= losses[0]:
        problems.append(f"expected {DEMO_STEPS} optimizer steps with finite, falling losses")
    if facade and extensions.exists() and (built := sorted(str(p) for p in extensions.rglob("*.so"))):
        problems.append(f"the facade run JIT-compiled {built}")
    if problems:
        raise Fail(detail + "; " + "; ".join(problems))
    return Part(name, "passed", detail, data=data)


def _launch(python: str, out: Path, extensions: Path, contender: str, index: int) -> dict[str, Any]:
    report_path = out / "overhead" / f"{contender}-{index}.json"
    env = clean_env(OMP_NUM_THREADS="4", TORCH_EXTENSIONS_DIR=str(extensions))
    if contender == "without":
        env["DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM"] = "1"
    command = [python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
               str(SCRIPT), "--zero-stage", "2", "--steps", str(STEPS), "--report", str(report_path), *MODEL]
    launched = time.time()
    rc, output = run(command, out / "logs" / f"overhead-{contender}-{index}.log", env=env, timeout=TIMEOUTS["launch"],
                     cwd=ROOT)
    if rc != 0 or not report_path.is_file():
        raise Fail(f"the {contender} launch {index} exited {rc}: {tail(output)}")
    report = json.loads(report_path.read_text())
    expected_plugin = PLUGIN if contender == "devshim" else None
    if report["plugin"] != expected_plugin or report["accelerator"] != "CUDA_Accelerator":
        raise Fail(f"the {contender} launch ran plugin {report['plugin']} on {report['accelerator']}, expected "
                   f"{expected_plugin} on DeepSpeed's CUDA_Accelerator (devshim standing aside)")
    steps = report["step_seconds"][WARMUP:]
    return {"step": statistics.median(steps), "first_step": report["first_step_done_at"] - launched,
            "losses": report["losses"]}


def overhead(python: str, out: Path, extensions: Path) -> Part:
    if not importable(python, "deepspeed", out):
        raise Skip("DeepSpeed is not installed in the machine's Python")
    (out / "overhead").mkdir(exist_ok=True)
    _launch(python, out, extensions, "without", 0)  # untimed: DeepSpeed's own ops are built (or loaded) once
    figures: dict[str, list[dict[str, Any]]] = {"devshim": [], "without": []}
    for round_ in range(ROUNDS):
        for contender in alternating(["devshim", "without"], round_):
            figures[contender].append(_launch(python, out, extensions, contender, round_ + 1))
    ours, theirs = ([f["step"] for f in figures[c]] for c in ("devshim", "without"))
    estimate = paired_ratio(ours, theirs)
    judged = verdict(estimate, TARGET)
    start = paired_ratio([f["first_step"] for f in figures["devshim"]], [f["first_step"] for f in figures["without"]])
    drift = max(abs(a - b) / max(abs(b), 1e-12) for r in range(ROUNDS)
                for a, b in zip(figures["devshim"][r]["losses"], figures["without"][r]["losses"], strict=True))
    data = {"rounds": ROUNDS, "steps": STEPS, "warmup": WARMUP, "model": MODEL, "target": TARGET,
            "ratio": estimate.ratio, "low": estimate.low, "high": estimate.high, "verdict": judged,
            "step_seconds": {"devshim": ours, "without": theirs},
            "launch_to_first_step_ratio": {"ratio": start.ratio, "low": start.low, "high": start.high},
            "largest_relative_loss_difference": drift}
    detail = (f"ZeRO-2 step with devshim's import / without: {estimate.ratio:.4f}x ({estimate.low:.4f}-"
              f"{estimate.high:.4f}, {ROUNDS} paired rounds), target <= {TARGET}x: {judged}; median step "
              f"{statistics.median(ours) * 1e3:.2f} ms vs {statistics.median(theirs) * 1e3:.2f} ms; launch to first "
              f"step {start.ratio:.3f}x (informational); largest loss difference {drift:.2e}")
    if judged == "missed":
        raise Fail(detail)
    return Part("overhead", "passed" if judged == "met" else "inconclusive", detail, data=data)


# -- the run ---------------------------------------------------------------------------------------------------------

PARTS = ("probe", "kit", "demo", "demo_facade", "overhead")


def plan(python: str, out: Path) -> dict[str, str]:
    """What each part would run (``--dry-run``)."""
    return {
        "probe": f"{python} -c <torch probe>; {python} -m devshim_core info --json",
        "kit": f"{python} -m pytest -p devshim_core.testing --noconftest --devshim-plugin={PLUGIN} "
               f"--junitxml={out / 'kit.xml'}",
        "demo": f"DEVSHIM_AUTO=1 {python} -m deepspeed.launcher.runner --num_gpus 1 {SCRIPT} --zero-stage 2 "
                f"--steps {DEMO_STEPS}",
        "demo_facade": "the same with DEVSHIM_CUDA_FACADE=1",
        "overhead": f"{ROUNDS} rounds x 2 launches of {python} -m torch.distributed.run --nproc-per-node 1 {SCRIPT} "
                    f"--zero-stage 2 --steps {STEPS} {' '.join(MODEL)}, with and without DEVSHIM_EXAMPLE_WITHOUT_"
                    "DEVSHIM=1",
    }


def run_parts(python: str, out: Path) -> list[Part]:
    extensions = Path(tempfile.mkdtemp(prefix="devshim-gpu-ext-"))
    steps = {"probe": lambda: probe(python, out), "kit": lambda: kit(python, out),
             "demo": lambda: demo(python, out, extensions, facade=False),
             "demo_facade": lambda: demo(python, out, extensions / "facade", facade=True),
             "overhead": lambda: overhead(python, out, extensions)}
    parts: list[Part] = []
    try:
        _run_each(steps, parts)
    finally:
        shutil.rmtree(extensions, ignore_errors=True)
    return parts


def _run_each(steps: dict[str, Any], parts: list[Part]) -> None:
    for name in PARTS:
        print(f"[gpu_check] {name} ...", flush=True)
        started = time.perf_counter()
        if parts and parts[0].status != "passed":
            part = Part(name, "skipped", f"the probe did not pass: {parts[0].detail}")
        elif name == "overhead" and any(p.name == "demo" and p.status == "failed" for p in parts):
            part = Part(name, "skipped", "the demo without devshim's facade failed, and these launches run the same")
        else:
            try:
                part = steps[name]()
            except Skip as skip:
                part = Part(name, "skipped", str(skip))
            except Fail as fail:
                part = Part(name, "failed", str(fail))
            except Exception as exc:  # a result this script did not expect: a failure, with what it was
                part = Part(name, "failed", f"{type(exc).__name__}: {exc}")
        part.seconds = time.perf_counter() - started
        print(f"[gpu_check] {name}: {part.status}: {part.detail.splitlines()[0] if part.detail else ''}", flush=True)
        parts.append(part)


def write_results(out: Path, parts: list[Part], facts: dict[str, Any]) -> int:
    failed = [p for p in parts if p.status == "failed"]
    skipped = [p for p in parts if p.status == "skipped"]
    outcome = "failed" if failed else "incomplete" if skipped else "passed"
    results = {"outcome": outcome, **facts, "parts": [asdict(p) for p in parts]}
    (out / "gpu-check.json").write_text(json.dumps(results, indent=2, default=str))
    lines = [f"devshim GPU check: {outcome}", *(f"{k}: {v}" for k, v in facts.items() if not isinstance(v, dict)), ""]
    for p in parts:
        lines.append(f"{p.status.upper():<12} {p.name:<12} {p.seconds:7.1f} s  {p.detail}")
    (out / "gpu-check.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 2 if skipped else 0


def _project(pyproject: Path) -> dict[str, str]:
    """``name`` and ``version`` of a pyproject.toml's [project] table (no tomllib before Python 3.11)."""
    text = pyproject.read_text().split("[project]", 1)[1]
    return {key: re.search(rf'^{key}\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1) for key in ("name", "version")}


def link_sources(venv: Path) -> str:
    """Make the repository importable in ``venv`` without building anything: a ``.pth`` naming each source directory
    and, per distribution, the ``.dist-info`` (metadata, entry points) pip would have written; no native libraries
    (devshim_kernels then runs its torch implementations)."""
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([str(venv / "bin" / "python"), "-c", where], text=True).strip())
    (site / "devshim-sources.pth").write_text("".join(f"{(ROOT / d).resolve()}\n" for d in SOURCES))
    (site / "devshim-auto.pth").write_text((ROOT / "build_support" / "devshim-auto.pth").read_text())
    for directory, entry_points in SOURCES.items():
        project = _project(ROOT / directory / "pyproject.toml")
        info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items())
            for group, points in entry_points.items()))
        (info / "INSTALLER").write_text("devshim-gpu-check\n")
    return f"source links in {site}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["link-sources"]:
        parser = argparse.ArgumentParser(prog="gpu_check.py link-sources")
        parser.add_argument("--venv", type=Path, required=True)
        print(link_sources(parser.parse_args(argv[1:]).venv))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--python", help="the venv's Python, whose torch sees the GPU")
    parser.add_argument("--install", default="", help="how devshim was installed into it (for the results)")
    parser.add_argument("--skip-reason", help="write the results of a run that cannot start, all parts skipped")
    parser.add_argument("--dry-run", action="store_true", help="say what each part would run; run nothing")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    facts: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
                             "repository": str(ROOT), "python": args.python, "install": args.install}
    if args.skip_reason or not args.python:
        reason = args.skip_reason or "no --python given"
        return write_results(out, [Part(name, "skipped", reason if name == PARTS[0] else "not run: see the probe")
                                   for name in PARTS], facts)
    if args.dry_run:
        return write_results(out, [Part(name, "skipped", f"dry run: would run {command}")
                                   for name, command in plan(args.python, out).items()], facts)
    parts = run_parts(args.python, out)
    facts["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return write_results(out, parts, facts)


if __name__ == "__main__":
    sys.exit(main())
