"""Tell Sophgo's torch_tpu from Google's without importing either."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
from typing import NamedTuple

CHIPS = ("sg2260", "bm1684x", "sg2260e", "bm1686")


class Found(NamedTuple):  # not a dataclass: this module loads on every start, and those cost ~1 ms
    ok: bool
    reason: str


def _vendor_from_metadata() -> str | None:
    """'sophgo', 'google' or None, from the metadata of the distributions that provide ``torch_tpu``."""
    for dist_name in metadata.packages_distributions().get("torch_tpu", []):
        try:
            meta = metadata.metadata(dist_name)
        except metadata.PackageNotFoundError:
            continue
        text = " ".join(str(v) for k, v in meta.items() if k in ("Author", "Author-email", "Home-page",
                                                                  "Project-URL", "Summary")).lower()
        requires = " ".join(metadata.requires(dist_name) or []).lower()
        if "sophgo" in text:
            return "sophgo"
        if "google" in text or "libtpu" in requires:
            return "google"
    return None


def _vendor_from_files(package_dir: str) -> str | None:
    if os.path.exists(os.path.join(package_dir, "_loader.py")) or os.path.isdir(os.path.join(package_dir,
                                                                                             "_internal")):
        return "google"
    lib = os.path.join(package_dir, "lib")
    has_tpudnn = os.path.isdir(lib) and any(name.startswith("libtpudnn") for name in os.listdir(lib))
    if os.path.exists(os.path.join(package_dir, "tpu", "__init__.py")) and has_tpudnn:
        return "sophgo"
    return None


def detect() -> Found:
    spec = importlib.util.find_spec("torch_tpu")
    if spec is None:
        return Found(False, "Sophgo's torch_tpu is not installed (it ships with Sophgo's SDK, not PyPI)")
    locations = list(spec.submodule_search_locations or [])
    vendor = _vendor_from_metadata() or (_vendor_from_files(locations[0]) if locations else None)
    if vendor == "google":
        return Found(False, "the installed torch_tpu is Google's TorchTPU (PyPI torch-tpu), not Sophgo's; "
                            "devshim will not import it")
    if vendor != "sophgo":
        return Found(False, f"a torch_tpu package is installed at {locations or spec.origin} but it cannot be "
                            "identified as Sophgo's (no Sophgo metadata, no tpu/ and lib/libtpudnn files); "
                            "devshim will not import it")
    chip = os.environ.get("CHIP_ARCH", "").strip().lower()
    if chip and chip not in CHIPS:
        return Found(False, f"CHIP_ARCH={chip!r} is not a Sophgo chip devshim knows ({', '.join(CHIPS)})")
    return Found(True, f"Sophgo torch_tpu found{f' for {chip}' if chip else ''}")
