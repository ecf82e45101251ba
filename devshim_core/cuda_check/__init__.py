"""``devshim check``: list a script's CUDA-only constructs and say, for each, whether devshim's CUDA redirect
serves it on the selected device or what the user must change. Scripts are parsed, never imported or run.

What the redirect serves is read from ``devshim_core.integrations.cuda_redirect.coverage``, the tables the
redirect itself is built from, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from devshim_core.cuda_check import rules
from devshim_core.cuda_check.scanner import Finding, scan_source
from devshim_core.cuda_check.target import Target, find_target

__all__ = ["CheckResult", "Finding", "Target", "check_paths", "find_target"]

SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "node_modules"})  # plus every hidden directory


@dataclass
class CheckResult:
    target: Target
    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # files that could not be read or parsed, with why
    files: int = 0  # files scanned

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
