"""Rendering a check: a compiler-style text report, or the findings as JSON. Errors go to stderr either way."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Collection
from typing import Any, TextIO

from devshim_core.cuda_check import CheckResult, Finding
from devshim_core.cuda_check.rules import CATEGORIES, PROBLEMS, Category
from devshim_core.cuda_check.target import REDIRECT_SWITCH, Target

# what ``--only`` takes: a category, or ``problems`` (what needs the user)
ONLY_CHOICES: tuple[str, ...] = ("problems", *CATEGORIES)


def shown_categories(only: str | None) -> Collection[Category]:
    """The categories ``--only ONLY`` prints (all of them without it)."""
    if only is None:
        return CATEGORIES
    if only == "problems":
        return PROBLEMS
    return [c for c in CATEGORIES if c == only]


def header(target: Target) -> list[str]:
    if target.device_type:
        where = f"redirect target: {target.device_type} (plugin {target.plugin})"
        if target.emulated:
            where += f" -- EMULATED (DEVSHIM_EMULATE={target.emulated}), not hardware"
    else:
        where = f"redirect target: unknown ({target.reason})"
    state = "on" if target.redirect else "OFF"
    return [where, f"CUDA redirect: {state} ({REDIRECT_SWITCH}, default on)"]


def summary(result: CheckResult, only: str | None = None) -> str:
    """Counts every finding, shown or not; the verdict separates what cannot run from what cannot run if reached."""
    counts = Counter(f.category for f in result.findings)
    tally = ", ".join(f"{counts[c]} {c}" for c in CATEGORIES)
    unreached = sum(1 for f in result.findings if f.category == "unsupported" and f.if_reached)
    if unreached:
        tally += f" ({unreached} if reached)"
    files = f"{result.files} file{'s' if result.files != 1 else ''} scanned"
    if only is not None:
        files += f", only {only} shown"
    if result.errors:
        verdict = f"{len(result.errors)} path(s) could not be checked"
    elif counts["unsupported"] > unreached:
        verdict = "cannot run until the unsupported constructs are changed"
    elif unreached:
        verdict = "cannot run where the unsupported lines marked 'if reached' run: check their conditions"
    else:
        verdict = "can run through devshim" + ("; read the review items" if counts["review"] else "")
    text = f"{files}: {tally} -- {verdict}"
    if result.log is not None:
        ran = len(result.log.ran)
        text += (f"\nmigration log ({result.log.logs} file{'s' if result.log.logs != 1 else ''}): {ran} ran, "
                 f"{len(result.findings) - ran} never ran, {len(result.log.only_at_run_time)} only at run time, "
                 f"{len(result.log.environment)} environment translations")
    return text


def line(f: Finding) -> str:
    """``path:line:col: category: construct -- message``, the category followed by ``(if reached: CONDITION)``."""
    where = f" (if reached: {f.if_reached})" if f.if_reached else ""
    return f"{f.path}:{f.line}:{f.col}: {f.category}{where}: {f.construct} -- {f.message}"


def _run(entry: dict[str, Any]) -> str:
    ranks = entry.get("ranks") or []
    on = f" (ranks {', '.join(map(str, ranks))})" if len(ranks) > 1 else ""
    return f"{entry['tag']}: {entry['call']} -- {entry['did']}{on}"


def log_mark(result: CheckResult, index: int) -> str:
    """`` [ran: TAG: CALL -- WHAT DEVSHIM DID]`` or `` [never ran]``; empty without a log."""
    if result.log is None:
        return ""
    entries = result.log.ran.get(index)
    return f" [ran: {'; '.join(_run(e) for e in entries)}]" if entries else " [never ran]"


def render_text(result: CheckResult, out: TextIO | None = None, only: str | None = None) -> None:
    out = out or sys.stdout  # looked up per call: the stream may be replaced after import
    for text in header(result.target):
        print(text, file=out)
    shown = shown_categories(only)
    for index, f in enumerate(result.findings):
        if f.category in shown:
            print(line(f) + log_mark(result, index), file=out)
    if result.log is not None:
        for entry in result.log.only_at_run_time:
            print(f"{entry['file']}:{entry['line']}: only at run time: {_run(entry)}", file=out)
        for entry in result.log.environment:
            print(f"environment: {_run(entry)}", file=out)
    print(summary(result, only), file=out)


def render_json(result: CheckResult, out: TextIO | None = None, only: str | None = None) -> None:
    out = out or sys.stdout
    shown = shown_categories(only)
    if result.log is None:
        json.dump([f.as_dict() for f in result.findings if f.category in shown], out, indent=2)
    else:  # with --log: the findings, each with what ran there, and what ran with no finding
        findings = [{**f.as_dict(), "ran": result.log.ran.get(i, [])}
                    for i, f in enumerate(result.findings) if f.category in shown]
        json.dump({"findings": findings, "only_at_run_time": result.log.only_at_run_time,
                   "environment": result.log.environment}, out, indent=2)
    print(file=out)


def render_errors(result: CheckResult, err: TextIO | None = None) -> None:
    err = err or sys.stderr
    for error in result.errors:
        print(f"devshim check: {error}", file=err)
