"""Pair two runs' dumps rank by rank, measure every record, find the first divergence, and say so: a table for the
terminal, JSON, and an HTML page with the per-layer error through the network and over the steps.

Records are paired by (step, kind, module, call, tensor) and walked in the order the run under test made them. The
first record beyond its dtype's tolerance (:mod:`~devshim_core.compare.metrics`) is *the first divergence*: the
earliest step at which anything differs, and within it the first module. Records only one run has are listed (a
module one device calls and the other does not is a difference too), never silently dropped.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devshim_core.compare.dump import Dump, Record, rank_directories
from devshim_core.compare.metrics import Metrics, measure, tolerance_of


@dataclass
class Row:
    """One paired record and its metrics."""

    record: Record
    metrics: Metrics | None  # None: the shapes differ
    broken: list[str]

    def as_json(self) -> dict[str, Any]:
        r = self.record
        return {"step": r.step, "order": r.order, "kind": r.kind, "module": r.module, "call": r.call,
                "tensor": r.tensor, "dtype": r.dtype, "shape": list(r.shape),
                "metrics": None if self.metrics is None else self.metrics.as_json(), "diverges": self.broken}


@dataclass
class RankComparison:
    rank: int
    rows: list[Row]
    only_in_run: list[str] = field(default_factory=list)
    only_in_reference: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # an incomplete or failed dump

    @property
    def first(self) -> Row | None:
        return next((row for row in self.rows if row.broken), None)


DIFFERENT_START = (
    "the two runs start from different weights, so everything after differs too: the script initialises them from "
    "a random generator the two devices draw differently (Megatron's RNG tracker, for one, forks the device's "
    "generator, which on the host reference is the CPU's own). Start both runs from the same saved weights (a "
    "checkpoint loaded before training), then compare again.")


def _describe(key: tuple[int, str, str, int, str]) -> str:
    step, kind, module, call, tensor = key
    return f"step {step} {kind} {module}" + (f" call {call}" if call else "") + ("" if tensor == "." else f"[{tensor}]")


HALF = ("bfloat16", "float16")


def judged_dtype(record: Record, half: str | None) -> str:
    """The dtype whose tolerance judges ``record``: its own, except in a mixed-precision run (``half``: the half
    precision its forward computes in), where fp32 master weights, gradients and outputs carry the half-precision
    compute's errors and are judged at that precision."""
    return half if half is not None and record.dtype == "float32" else record.dtype


def compare_rank(rank: int, run: Dump, reference: Dump) -> RankComparison:
    half = next((r.dtype for r in run.records if r.kind == "forward" and r.dtype in HALF), None)
    theirs = {r.key: r for r in reference.records}
    ours = {r.key for r in run.records}
    rows = []
    for record in sorted(run.records, key=lambda r: (r.step, r.order)):
        other = theirs.get(record.key)
        if other is None:
            continue
        if other.shape != record.shape:
            rows.append(Row(record, None, [f"shape {list(record.shape)} against the reference's {list(other.shape)}"]))
            continue
        metrics = measure(run.values(record), reference.values(other))
        rows.append(Row(record, metrics, metrics.breaks(tolerance_of(judged_dtype(record, half)))))
    problems = []
    for name, dump in (("run", run), ("reference", reference)):
        if dump.meta.get("error"):
            problems.append(f"the {name}'s recording failed: {dump.meta['error']}")
        elif not dump.meta.get("complete"):
            problems.append(f"the {name}'s dump is incomplete (the process ended before closing it)")
    if run.meta.get("steps") != reference.meta.get("steps"):
        problems.append(f"the run recorded {run.meta.get('steps')} steps, the reference {reference.meta.get('steps')}")
    return RankComparison(rank, rows, [_describe(k) for k in sorted(ours - set(theirs), key=str)][:50],
                          [_describe(k) for k in sorted(set(theirs) - ours, key=str)][:50], problems)


def compare_runs(run: Path, reference: Path) -> list[RankComparison]:
    ranks, reference_ranks = rank_directories(run), rank_directories(reference)
    if not ranks:
        raise FileNotFoundError(f"{run} holds no rank directories: the run recorded nothing (did the script import "
                                "devshim? `import devshim_core.auto`, or run it with DEVSHIM_AUTO=1)")
    if set(ranks) != set(reference_ranks):
        raise ValueError(f"the run recorded ranks {sorted(ranks)} and the reference ranks {sorted(reference_ranks)}: "
                         "run both with the same launcher and world size")
    return [compare_rank(rank, Dump(ranks[rank]), Dump(reference_ranks[rank])) for rank in sorted(ranks)]


def diverged(comparisons: list[RankComparison]) -> bool:
    return any(c.first is not None or c.problems for c in comparisons)


def as_json(comparisons: list[RankComparison], settings: dict[str, Any]) -> dict[str, Any]:
    return {"settings": settings, "diverged": diverged(comparisons), "ranks": [{
        "rank": c.rank, "problems": c.problems,
        "first_divergence": None if c.first is None else dict(
            c.first.as_json(), advice=DIFFERENT_START if c.first.record.kind == "init_param" else None),
        "only_in_run": c.only_in_run, "only_in_reference": c.only_in_reference,
        "records": [row.as_json() for row in c.rows]} for c in comparisons]}


def _fmt(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.3g}"


def terminal(comparisons: list[RankComparison], run_name: str, reference_name: str, limit: int = 12) -> str:
    lines = [f"devshim compare: {run_name} against {reference_name}"]
    for c in comparisons:
        first = c.first
        steps = sorted({row.record.step for row in c.rows})
        lines.append(f"rank {c.rank}: {len(c.rows)} records over {len(steps)} step(s)")
        lines += [f"  ! {problem}" for problem in c.problems]
        if c.only_in_run or c.only_in_reference:
            lines.append(f"  ! {len(c.only_in_run)} record(s) only in the run, {len(c.only_in_reference)} only in the "
                         f"reference (first: {(c.only_in_run + c.only_in_reference)[0]})")
        if first is None:
            measured = [(row.metrics.max_rel, row) for row in c.rows if row.metrics is not None]
            worst = max(measured, key=lambda pair: pair[0], default=None)
            tail = "" if worst is None else (f"; largest relative error {_fmt(worst[0])} at "
                                             f"{_describe(worst[1].record.key)}")
            lines.append(f"  within tolerance{tail}")
            continue
        lines.append(f"  FIRST DIVERGENCE: {_describe(first.record.key)} ({first.record.dtype}): "
                     f"{'; '.join(first.broken)}")
        if first.record.kind == "init_param":
            lines.append(f"  ! {DIFFERENT_START}")
        start = c.rows.index(first)
        lines.append(f"  {'step':>4} {'kind':<14} {'module':<48} {'cosine':>9} {'norm diff':>9} {'max abs':>9} "
                     f"{'max rel':>9} {'>1e-3':>7} {'>5e-3':>7}")
        for row in c.rows[max(0, start - 3):start + limit]:
            m, r = row.metrics, row.record
            name = (r.module + (f"[{r.tensor}]" if r.tensor != "." else ""))[-48:]
            flag = "  <- " if row is first else ("   x " if row.broken else "     ")
            if m is None:
                lines.append(f"{flag}{r.step:>4} {r.kind:<14} {name:<48} shape differs")
            else:
                lines.append(f"{flag}{r.step:>4} {r.kind:<14} {name:<48} {m.cosine:>9.6f} {_fmt(m.norm_rel):>9} "
                             f"{_fmt(m.max_abs):>9} {_fmt(m.max_rel):>9} {m.frac_rel_1e3:>7.1%} "
                             f"{m.frac_rel_5e3:>7.1%}")
    lines.append("RESULT: " + ("DIVERGED" if diverged(comparisons) else "same within tolerance"))
    return "\n".join(lines)


def _svg(comparison: RankComparison, width: int = 900, height: int = 320) -> str:
    """The forward outputs' largest relative error through the network (x: module in call order), one line per
    step, log scale: where the error enters and how it grows."""
    series: dict[int, list[float]] = {}
    for row in comparison.rows:
        if row.record.kind == "forward" and row.metrics is not None:
            series.setdefault(row.record.step, []).append(max(row.metrics.max_rel, 1e-12))
    if not series:
        return "<p>No forward records to plot.</p>"
    longest = max(len(v) for v in series.values())
    low = math.log10(min(min(v) for v in series.values()))
    high = max(math.log10(max(max(v) for v in series.values())), low + 1)
    left, bottom, top = 60, height - 30, 10

    def x(i: int) -> float:
        return left + (width - left - 10) * (i / max(longest - 1, 1))

    def y(value: float) -> float:
        return bottom - (bottom - top) * (math.log10(value) - low) / (high - low)

    colours = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#F0E442", "#000000"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="largest relative error of each forward output, per step">',
             f'<line x1="{left}" y1="{bottom}" x2="{width - 10}" y2="{bottom}" stroke="#444"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#444"/>']
    for exponent in range(math.floor(low), math.ceil(high) + 1):
        if low <= exponent <= high:
            parts.append(f'<text x="{left - 5}" y="{y(10.0 ** exponent) + 4:.1f}" font-size="11" '
                         f'text-anchor="end">1e{exponent}</text>')
    for n, (step, values) in enumerate(sorted(series.items())):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
        colour = colours[n % len(colours)]
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{width - 12}" y="{top + 12 + 13 * n}" font-size="11" text-anchor="end" '
                     f'fill="{colour}">step {step}</text>')
    parts.append(f'<text x="{(left + width) / 2}" y="{height - 5}" font-size="11" text-anchor="middle">forward '
                 "outputs in call order (input to loss)</text>")
    parts.append("</svg>")
    return "".join(parts)


def html_page(comparisons: list[RankComparison], run_name: str, reference_name: str) -> str:
    body = [f"<h1>devshim compare</h1><p>{html.escape(run_name)} against {html.escape(reference_name)}: "
            f"<strong>{'DIVERGED' if diverged(comparisons) else 'same within tolerance'}</strong></p>"]
    for c in comparisons:
        body.append(f"<h2>rank {c.rank}</h2>")
        body += [f"<p class=problem>{html.escape(p)}</p>" for p in c.problems]
        first = c.first
        where = "none" if first is None else (f"<strong>{html.escape(_describe(first.record.key))}</strong> "
                                              f"({html.escape('; '.join(first.broken))})")
        body.append(f"<p>First divergence: {where}</p>")
        body.append("<h3>Largest relative error of each forward output, per step (log scale)</h3>" + _svg(c))
        body.append("<table><tr><th>step</th><th>kind</th><th>module</th><th>dtype</th><th>cosine</th>"
                    "<th>norm diff</th><th>max abs</th><th>max rel</th><th>&gt;1e-3</th><th>&gt;5e-3</th></tr>")
        for row in c.rows:
            m, r = row.metrics, row.record
            cells = ["shape differs"] * 6 if m is None else [
                f"{m.cosine:.6f}", _fmt(m.norm_rel), _fmt(m.max_abs), _fmt(m.max_rel), f"{m.frac_rel_1e3:.1%}",
                f"{m.frac_rel_5e3:.1%}"]
            name = r.module + ("" if r.tensor == "." else f"[{r.tensor}]") + (f" call {r.call}" if r.call else "")
            body.append(f"<tr{' class=bad' if row.broken else ''}><td>{r.step}</td><td>{r.kind}</td>"
                        f"<td>{html.escape(name)}</td><td>{r.dtype}</td>" + "".join(f"<td>{v}</td>" for v in cells)
                        + "</tr>")
        body.append("</table>")
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px}tr.bad{background:#fdd}.problem{color:#a00}")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>devshim compare</title><style>{style}</style>"
            f"</head><body>{''.join(body)}</body></html>")


def write(comparisons: list[RankComparison], out: Path, settings: dict[str, Any], run_name: str,
          reference_name: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "compare.json", out / "compare.html"
    json_path.write_text(json.dumps(as_json(comparisons, settings), indent=1))
    html_path.write_text(html_page(comparisons, run_name, reference_name))
    return json_path, html_path
