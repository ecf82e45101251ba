"""Installed distributions' names and versions, read cheaply.

``importlib.metadata``'s ``version()`` parses the whole METADATA file with the email parser (about a
millisecond for torch's); devshim asks for a handful of versions on every start, inside the user's import
line, so it reads only the header lines it needs and remembers the answers for the process.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata


def _header(dist: metadata.Distribution, key: str) -> str | None:
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    if text is None:
        return None
    prefix = f"{key}:"
    for line in text.splitlines():
        if not line:  # the headers end at the first blank line; the long description follows
            break
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    return None


def name_and_version(dist: metadata.Distribution) -> tuple[str | None, str | None]:
    """The distribution's ``Name`` and ``Version`` headers."""
    return _header(dist, "Name"), _header(dist, "Version")


@functools.cache
def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or ``None`` when it is not installed."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    return _header(dist, "Version")
