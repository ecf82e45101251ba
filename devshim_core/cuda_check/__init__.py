"""``devshim check``: list a script's CUDA-only constructs and say, for each, whether devshim's CUDA redirect
serves it on the selected device or what the user must change. Scripts are parsed, never imported or run.

What the redirect serves is read from ``devshim_core.integrations.cuda_redirect.coverage``, the tables the
redirect itself is built from, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devshim_core.cuda_check import rules
from devshim_core.cuda_check.scanner import Finding, scan_source
from devshim_core.cuda_check.target import Target, find_target

__all__ = ["CheckResult", "Finding", "LogMerge", "Target", "check_paths", "find_target", "merge_logs"]

SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "node_modules"})  # plus every hidden directory


@dataclass
class LogMerge:
    """The scan merged with migration logs (``DEVSHIM_MIGRATION_LOG``): which findings ran (a log entry at the same
    file:line), which never ran, and what ran with no finding (in a line the scan passes over, or a file not
    scanned). Entries are the logs' JSON objects, one per (kind, file, line, call) across every log and rank."""

    ran: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # index in findings -> its entries
    only_at_run_time: list[dict[str, Any]] = field(default_factory=list)
    environment: list[dict[str, Any]] = field(default_factory=list)
    logs: int = 0

    def has_run(self, index: int) -> bool:
        return index in self.ran


@dataclass
class CheckResult:
    target: Target
    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # files that could not be read or parsed, with why
    files: int = 0  # files scanned
    log: LogMerge | None = None  # set by merge_logs

    @property
    def exit_status(self) -> int:
        """2: a path could not be checked; 1: something cannot run; 0: everything runs."""
        if self.errors:
            return 2
        return 1 if any(f.category == "unsupported" for f in self.findings) else 0


def _python_files(path: Path) -> Iterator[Path]:
    for child in sorted(path.rglob("*.py")):
        inner = child.relative_to(path).parts[:-1]
        if not any(part.startswith(".") or part in SKIPPED_DIRS for part in inner):
            yield child


def check_paths(paths: Iterable[str], target: Target) -> CheckResult:
    """Scan files and directories (recursively, ``*.py``); an unreadable file is an error, the rest go on."""
    result = CheckResult(target)
    for name in paths:
        path = Path(name)
        if path.is_dir():
            files = list(_python_files(path))
        elif path.exists():
            files = [path]
        else:
            result.errors.append(f"{name}: no such file or directory")
            continue
        for file in files:
            try:
                with tokenize.open(file) as stream:  # honours a PEP 263 coding line
                    source = stream.read()
                result.findings.extend(scan_source(source, str(file), target))
            except SyntaxError as exc:
                result.errors.append(f"{file}:{exc.lineno or 0}:{exc.offset or 0}: cannot parse: {exc.msg}")
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                result.errors.append(f"{file}: cannot read: {exc}")
            else:
                result.files += 1
    if not target.redirect:
        result.findings = [dataclasses.replace(f, category="unsupported", message=rules.REDIRECT_OFF_MESSAGE)
                           if f.category == "redirected" else f for f in result.findings]
    return result


def _read_log(path: str, errors: list[str]) -> list[dict[str, Any]]:
    entries = []
    try:
        with open(path, encoding="utf-8") as stream:
            for number, text in enumerate(stream, 1):
                if not text.strip():
                    continue
                try:
                    entry = json.loads(text)
                except json.JSONDecodeError as exc:
                    entry = exc.msg
                if not isinstance(entry, dict) or not {"kind", "call", "tag"} <= entry.keys():
                    errors.append(f"{path}:{number}: not a migration-log line (DEVSHIM_MIGRATION_LOG writes one JSON "
                                  "object per line): pass the file devshim wrote, or delete the damaged line")
                    continue
                entries.append(entry)
    except (OSError, UnicodeDecodeError) as exc:
        errors.append(f"{path}: cannot read the migration log: {exc}. Pass the path DEVSHIM_MIGRATION_LOG named "
                      "(with .rankN or the rank in place of {rank} where the job had ranks)")
    return entries


def merge_logs(result: CheckResult, logs: Iterable[str]) -> CheckResult:
    """Mark each finding of ``result`` ran or never ran from the migration logs at ``logs``; an unreadable log or line
    is an error (exit status 2), the rest are still merged."""
    merged = LogMerge()
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path in logs:
        merged.logs += 1
        for entry in _read_log(path, result.errors):
            key = (entry["kind"], entry.get("file"), entry.get("line"), entry["call"])
            if key not in seen:  # every rank logs the same site: one entry, the ranks it ran on
                seen[key] = {**entry, "ranks": []}
            rank = entry.get("rank")
            if rank is not None and rank not in seen[key]["ranks"]:
                seen[key]["ranks"].append(rank)
    lines: dict[tuple[str, int], list[int]] = {}
    for index, finding in enumerate(result.findings):
        lines.setdefault((os.path.realpath(finding.path), finding.line), []).append(index)
    for entry in seen.values():
        if entry["kind"] == "environment" or not entry.get("file"):
            merged.environment.append(entry)
            continue
        at = lines.get((os.path.realpath(entry["file"]), entry.get("line") or 0))
        if at is None:
            merged.only_at_run_time.append(entry)
        for index in at or ():
            merged.ran.setdefault(index, []).append(entry)
    result.log = merged
    return result
