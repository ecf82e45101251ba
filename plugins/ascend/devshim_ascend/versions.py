"""The versions of the Ascend software under the NPU, for ``devshim info``: read from CANN's and the driver's version
files and from torch-npu's metadata; nothing is imported and the device is never touched.

- CANN: the toolkit ``ASCEND_HOME_PATH`` (or ``ASCEND_TOOLKIT_HOME``) names, e.g.
  ``/usr/local/Ascend/ascend-toolkit/latest``. Its ``<arch>-linux/ascend_toolkit_install.info`` has ``version=8.0.RC1``
  (the file Ascend's install guides ``cat``, and that torch_npu's ``collect_env`` and DeepSpeed's NPU op builder
  read); ``version.cfg`` has ``toolkit_running_version=[7.3.0.1.231:8.0.RC2]`` (inner version, then the release);
  some installs have ``version.info`` with ``Version=``. The first one found is reported.
- driver: ``<install path>/driver/version.info``, ``Version=24.1.rc2``; the install path is
  ``Driver_Install_Path_Param`` in ``/etc/ascend_install.info``, by default ``/usr/local/Ascend``.
- torch_npu: the ``torch-npu`` distribution's version.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import platform
from collections.abc import Mapping
from pathlib import Path

CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
INSTALL_INFO = Path("/etc/ascend_install.info")
DEFAULT_INSTALL_PATH = Path("/usr/local/Ascend")
TOOLKIT_INFO = "ascend_toolkit_install.info"
VERSION_CFG_KEYS = ("toolkit_running_version", "runtime_running_version")


def _key_values(path: Path) -> dict[str, str]:
    """``key=value`` lines, keys lower-cased; empty when the file cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and not key.lstrip().startswith("#"):
            values.setdefault(key.strip().lower(), value.strip().strip("\"'"))
    return values


def _release_of_cfg(value: str) -> str:
    """``[7.3.0.1.231:8.0.RC2]`` -> ``8.0.RC2``: the release after the inner version."""
    return value.strip().strip("[]").rpartition(":")[2].strip()


def toolkit_version(home: Path) -> str | None:
    """The CANN version of the toolkit at ``home``, from the first version file found there."""
    arch = platform.machine()
    install_infos = [home / f"{arch}-linux" / TOOLKIT_INFO, *sorted(home.glob(f"*-linux/{TOOLKIT_INFO}"))]
    for path in install_infos:
        version = _key_values(path).get("version")
        if version:
            return version
    cfg = _key_values(home / "version.cfg")
    for key in VERSION_CFG_KEYS:
        version = _release_of_cfg(cfg.get(key, ""))
        if version:
            return version
    return _key_values(home / "version.info").get("version") or None


def cann_version(environ: Mapping[str, str] = os.environ) -> str | None:
    for name in CANN_ENV:
        home = environ.get(name, "").strip()
        if home and os.path.isdir(home):
            version = toolkit_version(Path(home))
            if version:
                return version
    return None


def driver_version(install_info: Path | None = None, default: Path | None = None) -> str | None:
    configured = _key_values(install_info or INSTALL_INFO).get("driver_install_path_param")
    roots = [Path(configured)] if configured else []
    for root in [*roots, default or DEFAULT_INSTALL_PATH]:
        version = _key_values(root / "driver" / "version.info").get("version")
        if version:
            return version
    return None


def torch_npu_version() -> str | None:
    try:
        return metadata.version("torch-npu")
    except metadata.PackageNotFoundError:
        return None


def runtime_versions() -> dict[str, str]:
    found = {"CANN": cann_version(), "driver": driver_version(), "torch_npu": torch_npu_version()}
    return {name: version for name, version in found.items() if version}
