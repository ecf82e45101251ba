"""``python -m bench``: run the benchmarks, print ratios against the peers, write ``bench/results.json``."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import platform
import sys
import traceback

import torch

from bench.common import Comparison, Note, Result

MODULES = ("host_adam", "attention", "fused_ops", "import_cost", "end_to_end", "vendor_peer", "cuda_redirect",
           "megatron_step", "file_io", "offload_step", "adam_identity")
DEFAULT_OUTPUT = pathlib.Path(__file__).resolve().parent / "results.json"


def machine() -> dict[str, object]:
    model = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _seconds(value: float) -> str:
    return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.2f} s"


def _line(result: Result) -> str:
    if isinstance(result, Comparison):
        verdict = "met" if result.met else getattr(result, "verdict", "missed").replace("missed", "MISSED")
        return (f"{result.group:<11} {result.case:<44} {result.subject[:26]:<26} {_seconds(result.subject_seconds):>10}"
                f"  {result.peer[:30]:<30} {_seconds(result.peer_seconds):>10}  {result.ratio:6.3f}×  "
                f"{result.target:<24} {verdict}")
    verdict = "" if result.met is None else ("met" if result.met else "MISSED")
    return f"{result.group:<11} {result.name:<70} {result.value:12.3f} {result.unit:<6} {result.target:<12} {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, no compiled peers: a smoke run")
    parser.add_argument("--only", default=",".join(MODULES), help=f"comma-separated subset of {','.join(MODULES)}")
    parser.add_argument("--output", type=pathlib.Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--merge", action="store_true",
                        help="keep the other groups' results already in --output (re-run some benchmarks only)")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(MODULES))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(MODULES)}")

    results: list[Result] = []
    failures: dict[str, str] = {}
    print(f"devshim benchmarks{' (quick)' if args.quick else ''}: time ratio = devshim / peer (below 1: devshim "
          f"faster)", flush=True)
    for name in chosen:
        try:
            found = importlib.import_module(f"bench.{name}").run(quick=args.quick)
        except Exception:  # one broken benchmark must not hide the others' numbers
            failures[name] = traceback.format_exc()
            print(f"{name}: FAILED\n{failures[name]}", file=sys.stderr, flush=True)
            continue
        for result in found:
            print(_line(result), flush=True)
        results.extend(found)

    comparisons = [r.as_json() for r in results if isinstance(r, Comparison)]
    notes = [r.as_json() for r in results if isinstance(r, Note)]
    if args.merge and args.output.exists():
        previous = json.loads(args.output.read_text())
        fresh = {r["group"] for r in comparisons + notes}
        comparisons = [r for r in previous["comparisons"] if r["group"] not in fresh] + comparisons
        notes = [r for r in previous["notes"] if r["group"] not in fresh] + notes
    judged = comparisons + [n for n in notes if n["met"] is not None]
    met = sum(bool(r["met"]) for r in judged)
    document = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine(),
        "comparisons": comparisons,
        "notes": notes,
        "targets": {"met": met, "judged": len(judged)},
        "failures": failures,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"targets met: {met}/{len(judged)}; results in {args.output}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
