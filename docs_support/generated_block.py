"""Rewrite a generated block of a Markdown page: the lines between a start marker's line and an end marker.

The table generators (``settings_table.py``, ``cuda_table.py``) share it; they are run as scripts, so this module is
found beside them.
"""

from __future__ import annotations

from pathlib import Path


def rewrite_block(page: Path, start: str, end: str, body: str) -> bool:
    """Replace what lies between the line holding ``start`` and ``end`` with ``body``; True when the page changed."""
    text = page.read_text()
    body_start = text.index("\n", text.index(start)) + 1
    body_end = text.index(end, body_start)
    new = text[:body_start] + body + "\n" + text[body_end:]
    if new != text:
        page.write_text(new)
    return new != text
