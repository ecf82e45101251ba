"""The versions of the Sophgo software under the TPU, for ``devshim info``: read from metadata, torch_tpu's own files
and the driver's ``/proc`` entries; nothing is imported and the device is never touched.

- torch_tpu: the distribution's version (only called once detection identified the package as Sophgo's).
- backend: ``BACKEND_VERSION`` in ``torch_tpu/tpu/_versions.py``, which Sophgo's build fills in (the TPU1686 revision
  ``torch_tpu.tpu.versions`` reports; ``None`` in a source checkout, then left out).
- driver: ``/proc/bmsophon/driver_version`` of libsophon's PCIe driver (BM1684X), ``release version:0.5.1   release
  date: 20240717-103602``; and ``/proc/sgdrv/driver_date`` of the SG2260 driver, which is a date, not a version (what
  ``torch_tpu.tpu.versions.driver_version()`` reads).
- libsophon: the version in the name of the ``/opt/sophon/libsophon-current`` link's target (``libsophon-0.5.1``),
  as Sophgo's ``get_info.sh`` reads it.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import os
import re
from pathlib import Path

BMSOPHON_DRIVER = Path("/proc/bmsophon/driver_version")
SGDRV_DRIVER_DATE = Path("/proc/sgdrv/driver_date")
LIBSOPHON_CURRENT = Path("/opt/sophon/libsophon-current")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip() or None
    except OSError:
        return None


def torch_tpu_version() -> str | None:
    try:
        return metadata.version("torch-tpu")
    except metadata.PackageNotFoundError:
        return None


def _package_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("torch_tpu")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def backend_version(package_dir: Path | None = None) -> str | None:
    """``BACKEND_VERSION`` as a string constant in ``tpu/_versions.py``, parsed, not imported."""
    package_dir = package_dir or _package_dir()
    text = _read(package_dir / "tpu" / "_versions.py") if package_dir else None
    if not text:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "BACKEND_VERSION"
                                                 for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) and node.value.value):
            return node.value.value
    return None


def driver_version(path: Path | None = None) -> str | None:
    match = re.search(r"release version:\s*(\S+)", _read(path or BMSOPHON_DRIVER) or "")
    return match.group(1) if match else None


def driver_date(path: Path | None = None) -> str | None:
    return _read(path or SGDRV_DRIVER_DATE)


def libsophon_version(link: Path | None = None) -> str | None:
    try:
        target = os.readlink(link or LIBSOPHON_CURRENT)
    except OSError:
        return None
    name = Path(target.rstrip("/")).name
    if not name.startswith("libsophon-"):
        return None
    return name[len("libsophon-"):] or None


def runtime_versions() -> dict[str, str]:
    found = {"torch_tpu": torch_tpu_version(), "backend": backend_version(), "driver": driver_version(),
             "driver date": driver_date(), "libsophon": libsophon_version()}
    return {name: version for name, version in found.items() if version}
