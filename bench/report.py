"""``python -m bench.report [results.json]``: the results as Markdown tables, for docs/performance.md."""

from __future__ import annotations

import json
import pathlib
import sys

from bench.__main__ import DEFAULT_OUTPUT


def _seconds(value: float) -> str:
    return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.1f} s"


def render(document: dict) -> str:
    machine = document["machine"]
    lines = [f"Measured {document['date']} on {machine['cpu']} ({machine['logical_cpus']} logical CPUs, "
             f"torch {machine['torch']} with {machine['torch_threads']} threads, CPU capability "
             f"{machine['cpu_capability']}, Python {machine['python']}). Targets met: "
             f"{document['targets']['met']}/{document['targets']['judged']}.", ""]
    groups = dict.fromkeys(r["group"] for r in document["comparisons"] + document["notes"])
    for group in groups:
        lines += [f"### {group}", "", "| case | devshim | peer | ratio | target | met |", "|---|---|---|---|---|---|"]
        for r in (r for r in document["comparisons"] if r["group"] == group):
            met = "yes" if r["met"] else ("inconclusive" if r.get("verdict") == "inconclusive" else "**no**")
            lines.append(f"| {r['case']} | {r['subject']}: {_seconds(r['subject_seconds'])} | {r['peer']}: "
                         f"{_seconds(r['peer_seconds'])} | {r['ratio']:.3f}× | {r['target']} | {met} |")
        notes = [n for n in document["notes"] if n["group"] == group]
        for n in notes:
            met = "" if n["met"] is None else ("yes" if n["met"] else "**no**")
            lines.append(f"| {n['name']} | {n['value']:.3f} {n['unit']} | | | {n['target']} | {met} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    path = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUTPUT
    print(render(json.loads(path.read_text())))
