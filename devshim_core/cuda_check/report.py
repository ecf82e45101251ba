"""Rendering a check: a compiler-style text report, or the findings as JSON. Errors go to stderr either way."""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import TextIO

from devshim_core.cuda_check import CheckResult
from devshim_core.cuda_check.rules import CATEGORIES
from devshim_core.cuda_check.target import REDIRECT_SWITCH, Target


def header(target: Target) -> list[str]:
    if target.device_type:
        where = f"redirect target: {target.device_type} (plugin {target.plugin})"
        if target.emulated:
            where += f" -- EMULATED (DEVSHIM_EMULATE={target.emulated}), not hardware"
    else:
        where = f"redirect target: unknown ({target.reason})"
    state = "on" if target.redirect else "OFF"
    return [where, f"CUDA redirect: {state} ({REDIRECT_SWITCH}, default on)"]


def summary(result: CheckResult) -> str:
    counts = Counter(f.category for f in result.findings)
    tally = ", ".join(f"{counts[c]} {c}" for c in CATEGORIES)
    files = f"{result.files} file{'s' if result.files != 1 else ''} scanned"
    if result.errors:
        verdict = f"{len(result.errors)} path(s) could not be checked"
    elif counts["unsupported"]:
        verdict = "cannot run until the unsupported constructs are changed"
    else:
        verdict = "can run through devshim" + ("; read the review items" if counts["review"] else "")
    return f"{files}: {tally} -- {verdict}"


def render_text(result: CheckResult, out: TextIO | None = None) -> None:
    out = out or sys.stdout  # looked up per call: the stream may be replaced after import
    for line in header(result.target):
        print(line, file=out)
    for f in result.findings:
        print(f"{f.path}:{f.line}:{f.col}: {f.category}: {f.construct} -- {f.message}", file=out)
    print(summary(result), file=out)


def render_json(result: CheckResult, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    json.dump([f.as_dict() for f in result.findings], out, indent=2)
    print(file=out)


def render_errors(result: CheckResult, err: TextIO | None = None) -> None:
    err = err or sys.stderr
    for error in result.errors:
        print(f"devshim check: {error}", file=err)
