"""The migration log: what devshim did at run time, one JSON line per call site (``DEVSHIM_MIGRATION_LOG=PATH``).

Each line records a call site that the CUDA redirect served (``served``), served with a difference from CUDA's
answer (``modified``, ``coverage.MODIFIED``) or refused (``refused``), once per process, with the caller's file and
line; plus each CUDA/NCCL environment translation and each blocked module import. ``devshim check --log PATH`` merges
the log with the static scan. Unset, :func:`recorder` is ``None`` and nothing here runs: the redirect keeps its native
wrappers. Set, the redirect uses its Python wrappers, which record before they forward (or raise).

Per rank: ``{rank}`` in the path is replaced by the rank (``RANK``, else ``LOCAL_RANK``, else 0); a path without it
gets ``.rank{N}`` appended when ``RANK`` or ``LOCAL_RANK`` is set, so ranks never write one file.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable
from types import FrameType
from typing import IO, Any

ENV = "DEVSHIM_MIGRATION_LOG"
TAGS = ("served", "modified", "refused")
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # devshim_core's own frames are never call sites


def _rank() -> str | None:
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def log_path(template: str) -> str:
    """The file this process writes for ``DEVSHIM_MIGRATION_LOG=template`` (see the module doc)."""
    rank = _rank()
    if "{rank}" in template:
        return template.replace("{rank}", rank or "0")
    return f"{template}.rank{rank}" if rank is not None else template


def _outside_devshim(frame: FrameType | None) -> FrameType | None:
    """The first frame, from ``frame`` up, that is neither devshim's nor the import machinery's."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_PACKAGE) or name.startswith("<frozen importlib")):
            return frame
        frame = frame.f_back
    return None


class Recorder:
    """Writes each (kind, file, line, call) once: appended and flushed at once, so a killed rank keeps its lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: set[tuple[str, str, int, str]] = set()
        self.sites: set[tuple[str, int, str]] = set()  # call sites as the frames name them: the fast check
        self._lock = threading.Lock()
        self._file: IO[str] | None = None  # opened at the first line: a run that records nothing writes no file

    def call(self, call: str, tag: str, did: str, *args: Any) -> None:
        """Record the caller of the wrapper calling this, with ``did.format(*args)`` (formatted only the first time:
        a seen site costs a frame lookup and a set lookup). A call made by devshim itself (``Module.cuda`` calling
        ``Module.to``) is not a script's call site: skipped."""
        frame = sys._getframe(2)
        code = frame.f_code
        site = (code.co_filename, frame.f_lineno, call)
        if site in self.sites:
            return
        self.sites.add(site)
        if not code.co_filename.startswith(_PACKAGE):
            self._write("call", os.path.abspath(code.co_filename), frame.f_lineno, call, tag, did.format(*args))

    def blocked_import(self, name: str, reason: str) -> None:
        frame = _outside_devshim(sys._getframe(1))
        file, line = (os.path.abspath(frame.f_code.co_filename), frame.f_lineno) if frame is not None else ("", 0)
        self._write("import", file, line, f"import {name}", "refused", reason)

    def environment(self, source: str, outcome: str, tag: str, did: str) -> None:
        self._write("environment", "", 0, source, tag, did, outcome=outcome)

    def _write(self, kind: str, file: str, line: int, call: str, tag: str, did: str, **extra: str) -> None:
        key = (kind, file, line, call)
        if key in self.seen:
            return
        with self._lock:
            if key in self.seen:
                return
            self.seen.add(key)
            entry = {"kind": kind, "file": file or None, "line": line or None, "call": call, "tag": tag, "did": did,
                     "rank": _rank(), "pid": os.getpid(), **extra}
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  # held for the process's life
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()


_UNSET = object()
_recorder: Any = _UNSET


def recorder() -> Recorder | None:
    """The process's recorder, or ``None`` when ``DEVSHIM_MIGRATION_LOG`` is unset (read once, at the first ask)."""
    global _recorder
    if _recorder is _UNSET:
        template = os.environ.get(ENV, "").strip()
        _recorder = Recorder(log_path(template)) if template else None
    return _recorder


# -- environment translations and blocked imports -------------------------------------------------------------------

_ENV_TAGS = {"applied": "served", "already set": "served"}  # the rest (not applied, untranslatable, ignored): no effect


def record_translations(translations: Iterable[Any]) -> None:
    """Each ``env_migration.Translation``: applied or already set is ``served``; the rest had no effect, ``refused``."""
    rec = recorder()
    if rec is None:
        return
    for t in translations:
        rec.environment(t.source, t.outcome, _ENV_TAGS.get(t.outcome, "refused"), t.describe())


