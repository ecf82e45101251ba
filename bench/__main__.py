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

from bench.common import Comparison, Note, Result, seconds_text
from bench.stats import VERDICTS

MODULES = ("host_adam", "attention", "fused_ops", "import_cost", "end_to_end", "vendor_peer", "cuda_redirect",
           "megatron_step", "file_io", "offload_step", "adam_identity", "collectives")
DEFAULT_OUTPUT = pathlib.Path(__file__).resolve().parent / "results.json"
QUICK_OUTPUT = DEFAULT_OUTPUT.with_name("results-quick.json")  # a smoke run never replaces the real figures


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


def _line(result: Result) -> str:
    if isinstance(result, Comparison):
        verdict = result.verdict.upper() if result.verdict == "missed" else result.verdict
        return (f"{result.group:<11} {result.case[:60]:<60} {result.subject[:26]:<26} "
                f"{seconds_text(result.subject_seconds):>10}  {result.peer[:30]:<30} "
                f"{seconds_text(result.peer_seconds):>10}  "
                f"{result.ratio:6.3f}× [{result.estimate.low:.3f}, {result.estimate.high:.3f}]  "
                f"{result.target[:40]:<40} {verdict}")
    return f"{result.group:<11} {result.name[:90]:<90} {result.value:12.3f} {result.unit}"


def tally(comparisons: list[dict]) -> dict[str, int]:
    """The targets of a run: each judged comparison once, by verdict. Two judged rows that compare the same
    contenders in the same case would count one target twice, so they are refused."""
    judged = [r for r in comparisons if r["judged"]]
    seen: set[tuple[str, str, str, str]] = set()
    for r in judged:
        key = (r["group"], r["case"], r["subject"], r["peer"])
        if key in seen:
            raise ValueError(f"a target is judged twice: {key}")
        seen.add(key)
    counts = {verdict: sum(r["verdict"] == verdict for r in judged) for verdict in VERDICTS}
    return {"judged": len(judged), **counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, no compiled peers: a smoke run")
    parser.add_argument("--only", default=",".join(MODULES), help=f"comma-separated subset of {','.join(MODULES)}")
    parser.add_argument("--output", type=pathlib.Path,
                        help=f"default: {DEFAULT_OUTPUT.name}, or {QUICK_OUTPUT.name} with --quick")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other groups' results already in --output (re-run some benchmarks only)")
    args = parser.parse_args(argv)
    args.output = args.output or (QUICK_OUTPUT if args.quick else DEFAULT_OUTPUT)
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
    targets = tally(comparisons)
    document = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine(),
        "comparisons": comparisons,
        "notes": notes,
        "targets": targets,
        "failures": failures,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"targets: {targets['met']} met, {targets['missed']} missed, {targets['inconclusive']} inconclusive "
          f"of {targets['judged']}; results in {args.output}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
