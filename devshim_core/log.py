"""devshim's logger, ``logging.getLogger("devshim")`` and its children (``devshim.patching``, ``devshim.kernels``, ...).

Events a user must see (a plugin passed over, a misspelled switch, the emulator's build, a refused flag) are logged at
warning or info and reach stderr by default, as ``devshim: <message>``, through a handler of devshim's own: a library
must not depend on the application having configured logging. ``DEVSHIM_LOG_LEVEL=debug`` also shows every patch
applied and every kernel dispatch decision. An application that configures logging itself can take the records over:
``logging.getLogger("devshim").handlers.clear()`` and ``.propagate = True``.
"""

from __future__ import annotations

import logging
import os
import sys

NAME = "devshim"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (pytest's capture, a redirected stream), not to the stream
    that was current when the handler was made."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # over StreamHandler's attribute: looked up at each record
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def logger(child: str | None = None) -> logging.Logger:
    """devshim's logger (or its ``child``), with devshim's stderr handler and ``DEVSHIM_LOG_LEVEL`` applied once."""
    root = logging.getLogger(NAME)
    if not any(isinstance(h, _Stderr) for h in root.handlers) and not getattr(root, "_devshim_configured", False):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("devshim: %(message)s"))
        root.addHandler(handler)
        root.propagate = False
        raw = os.environ.get("DEVSHIM_LOG_LEVEL", "").strip().lower()
        root.setLevel(LEVELS.get(raw, logging.INFO))
        root._devshim_configured = True  # type: ignore[attr-defined]  # a later clear() by the application stands
    return root.getChild(child) if child else root
