"""Tell Sophgo's torch_tpu from Google's without importing either; then load Sophgo's and count its TPUs.

``torch_tpu`` is also the import name of Google's TorchTPU (PyPI ``torch-tpu``), which aborts the interpreter
when imported without Google's runtime: it is identified by metadata and files, and only a package identified
as Sophgo's is ever imported.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as metadata
import importlib.util
import os
from typing import NamedTuple

CHIPS = ("sg2260", "bm1684x", "sg2260e", "bm1686")
NOT_INSTALLED = "Sophgo's torch_tpu is not installed (it ships with Sophgo's SDK, not PyPI)"


class Found(NamedTuple):  # not a dataclass: this module loads on every start, and those cost ~1 ms
    ok: bool
    reason: str
    device_count: int = 0
    chip: str = ""  # CHIP_ARCH as given, or as torch_tpu chose it when it was unset


def _vendors_from_metadata() -> set[str]:
    """The vendors ('sophgo', 'google') of the distributions that provide ``torch_tpu``, as far as they can be told."""
    vendors = set()
    for dist_name in metadata.packages_distributions().get("torch_tpu", []):
        try:
            meta = metadata.metadata(dist_name)
        except metadata.PackageNotFoundError:
            continue
        # the PackageMetadata protocol declares no items(); what metadata() returns is an email.message.Message
        text = " ".join(str(v) for k, v in meta.items()  # type: ignore[attr-defined]  # a Message: see above
                        if k in ("Author", "Author-email", "Home-page", "Project-URL", "Summary")).lower()
        requires = " ".join(metadata.requires(dist_name) or []).lower()
        if "sophgo" in text:
            vendors.add("sophgo")
        elif "google" in text or "libtpu" in requires:
            vendors.add("google")
    return vendors


def _vendor_from_files(package_dir: str) -> str | None:
    if os.path.exists(os.path.join(package_dir, "_loader.py")) or os.path.isdir(os.path.join(package_dir,
                                                                                             "_internal")):
        return "google"
    lib = os.path.join(package_dir, "lib")
    has_tpudnn = os.path.isdir(lib) and any(name.startswith("libtpudnn") for name in os.listdir(lib))
    if os.path.exists(os.path.join(package_dir, "tpu", "__init__.py")) and has_tpudnn:
        return "sophgo"
    return None


def _chips_built(package_dir: str) -> list[str]:
    """The chips this build ships kernels for: torch_tpu loads ``lib/libtpudnn.<chip>.so`` for CHIP_ARCH."""
    lib = os.path.join(package_dir, "lib")
    if not os.path.isdir(lib):
        return []
    return sorted(name[len("libtpudnn."):-len(".so")] for name in os.listdir(lib)
                  if name.startswith("libtpudnn.") and name.endswith(".so") and name.count(".") == 2)


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _load_advice(chip: str) -> str:
    """What to check when Sophgo's torch_tpu fails to load."""
    try:
        tpu_version, torch_version = metadata.version("torch-tpu"), metadata.version("torch")
    except metadata.PackageNotFoundError:
        tpu_version = torch_version = ""
    if tpu_version and _minor(tpu_version) != _minor(torch_version):
        return (f"torch_tpu {tpu_version} is built for torch {_minor(tpu_version)} but torch {torch_version} is "
                f"installed: install the torch it was built for, or a torch_tpu built for torch "
                f"{_minor(torch_version)}")
    chosen = (f"CHIP_ARCH={chip} loads lib/libtpudnn.{chip}.so and libtpurt.{chip}.so" if chip else
              "with CHIP_ARCH unset it tries each chip's lib/libtpudnn.<chip>.so")
    return (f"{chosen}: set CHIP_ARCH to your chip ({', '.join(CHIPS)}), check that the Sophgo driver and runtime "
            "are installed, and that this torch_tpu was built for the installed torch")


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except ValueError:  # in sys.modules without a __spec__ (a stub put there by hand): installed, origin unknown
        return importlib.machinery.ModuleSpec(name, None)


def detect() -> Found:
    spec = _find_spec("torch_tpu")
    if spec is None:
        return Found(False, NOT_INSTALLED)
    locations = list(spec.submodule_search_locations or [])
    by_metadata = _vendors_from_metadata()
    if len(by_metadata) > 1:
        return Found(False, "two distributions provide the torch_tpu package, Google's TorchTPU (PyPI torch-tpu) and "
                            "Sophgo's: devshim will not import either; uninstall Google's (pip uninstall torch-tpu) "
                            "and reinstall Sophgo's torch_tpu from its SDK")
    vendor = next(iter(by_metadata), None) or (_vendor_from_files(locations[0]) if locations else None)
    if vendor == "google":
        return Found(False, "the installed torch_tpu is Google's TorchTPU (PyPI torch-tpu), not Sophgo's; "
                            "devshim will not import it (without Google's TPU runtime importing it aborts the "
                            "process, and torch loads it on `import torch` unless TORCH_DEVICE_BACKEND_AUTOLOAD=0). "
                            "For a Sophgo TPU: pip uninstall torch-tpu, then install Sophgo's torch_tpu from its SDK")
    if vendor != "sophgo":
        where = locations or spec.origin or "an unknown place"
        return Found(False, f"a torch_tpu package is installed at {where} but it cannot be "
                            "identified as Sophgo's (no Sophgo metadata, no tpu/ and lib/libtpudnn files); "
                            "devshim will not import it")
    chip = os.environ.get("CHIP_ARCH", "").strip().lower()
    if chip and chip not in CHIPS:
        return Found(False, f"CHIP_ARCH={chip!r} is not a Sophgo chip devshim knows ({', '.join(CHIPS)})")
    built = _chips_built(locations[0]) if locations else []
    if chip and built and chip not in built:
        return Found(False, f"CHIP_ARCH={chip} but this torch_tpu ({locations[0]}) ships no lib/libtpudnn.{chip}.so "
                            f"(it is built for {', '.join(built)}): set CHIP_ARCH to one of those, unset it to let "
                            f"torch_tpu choose, or install a torch_tpu built for {chip}")
    try:
        import torch
        import torch_tpu  # noqa: F401 - identified as Sophgo's above: safe to import
    except (ImportError, OSError, RuntimeError) as exc:
        return Found(False, f"Sophgo's torch_tpu failed to load: {type(exc).__name__}: {exc}; {_load_advice(chip)}",
                     chip=chip)
    chip = os.environ.get("CHIP_ARCH", "").strip().lower() or chip  # torch_tpu sets it when it chose the chip
    on = f" on {chip}" if chip else ""
    try:
        available = torch.tpu.is_available()  # type: ignore[attr-defined]  # registered by torch_tpu
        count = torch.tpu.device_count() if available else 0  # type: ignore[attr-defined]  # registered by torch_tpu
    except (RuntimeError, AttributeError) as exc:
        return Found(False, f"Sophgo's torch_tpu loaded{on} but asking it for TPUs failed: {type(exc).__name__}: "
                            f"{exc}; check the Sophgo driver and CHIP_ARCH", chip=chip)
    if not count:
        visible = os.environ.get("TPU_VISIBLE_DEVICES")
        where = (f"TPU_VISIBLE_DEVICES={visible!r} may hide them" if visible is not None
                 else "check TPU_VISIBLE_DEVICES")
        return Found(False, f"Sophgo's torch_tpu loaded{on} but no TPU is visible ({where}, that CHIP_ARCH names "
                            "the installed chip, and the Sophgo driver)", chip=chip)
    return Found(True, f"{count} Sophgo TPUs{on} (torch_tpu)", count, chip)
