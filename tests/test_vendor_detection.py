"""Spec: the Ascend and Sophgo plugins (detect-only in this release) say what they found, and never import a
vendor package speculatively: torch_npu needs CANN first, and ``torch_tpu`` is also the import name of
Google's TorchTPU, which aborts the interpreter without Google's runtime.

Fake vendor packages are put on PYTHONPATH of a subprocess; each records in a marker file if it is ever
imported, then fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plugin_fixtures import PYTHON, clean_env, run, write_distribution

DETECT_BOTH = """\
import json, sys
import devshim_ascend, devshim_sophgo
from devshim_ascend.detect import detect as detect_ascend
from devshim_sophgo.detect import detect as detect_sophgo
out = {}
for name, plugin, detect in (("ascend", devshim_ascend, detect_ascend), ("sophgo", devshim_sophgo, detect_sophgo)):
    report, found = plugin.devshim_detect(), detect()
    out[name] = {"available": report.available, "reason": report.reason, "device_type": report.device_type,
                 "priority": report.priority, "found": found.ok, "found_reason": found.reason}
out["imported"] = sorted(m for m in ("torch_npu", "torch_tpu") if m in sys.modules)
print(json.dumps(out))
"""


class Machine:
    """A directory of fake vendor packages and what detection makes of it."""

    def __init__(self, root: Path) -> None:
        self.site = root / "site"
        self.site.mkdir()
        self.marker = root / "vendor-package-was-imported"

    def package(self, name: str, *extra_files: str) -> Path:
        """A package ``name`` whose import writes the marker file and fails, plus empty ``extra_files``."""
        package = self.site / name
        package.mkdir()
        (package / "__init__.py").write_text(f"open({str(self.marker)!r}, 'w').write({name!r})\n"
                                             f"raise ImportError('devshim must not import {name} here')\n")
        for relative in extra_files:
            path = package / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            if not relative.endswith("/"):
                path.write_text("")
        return package

    def detect(self, **env: str) -> dict:
        result = run([PYTHON, "-c", DETECT_BOTH], clean_env(pythonpath=[self.site], **env))
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    @property
    def vendor_package_was_imported(self) -> bool:
        return self.marker.exists()


@pytest.fixture
def machine(tmp_path) -> Machine:
    return Machine(tmp_path)


def test_with_no_vendor_package_installed_both_report_unavailable_and_say_what_to_install(machine):
    found = machine.detect()
    assert found["ascend"] == {
        "available": False, "device_type": "npu", "priority": 100, "found": False,
        "reason": "torch_npu is not installed (install Huawei's torch-npu matching your torch, with the CANN toolkit)",
        "found_reason": "torch_npu is not installed (install Huawei's torch-npu matching your torch, with the CANN "
                        "toolkit)"}
    assert found["sophgo"]["available"] is False
    assert (found["sophgo"]["device_type"], found["sophgo"]["priority"]) == ("tpu", 100)
    assert found["sophgo"]["reason"] == "Sophgo's torch_tpu is not installed (it ships with Sophgo's SDK, not PyPI)"
    assert found["imported"] == []


# -- Ascend --------------------------------------------------------------------------------------


def test_torch_npu_without_the_cann_toolkit_is_reported_and_not_imported(machine):
    machine.package("torch_npu")
    found = machine.detect()
    assert found["ascend"]["available"] is False
    assert found["ascend"]["reason"] == ("torch_npu is installed but the CANN toolkit was not found: source CANN's "
                                         "set_env.sh or set ASCEND_HOME_PATH")
    assert found["imported"] == [] and not machine.vendor_package_was_imported


def test_an_ascend_home_path_that_is_not_a_directory_does_not_count_as_cann(machine, tmp_path):
    machine.package("torch_npu")
    found = machine.detect(ASCEND_HOME_PATH=str(tmp_path / "no-such-cann"))
    assert "CANN toolkit was not found" in found["ascend"]["reason"]
    assert not machine.vendor_package_was_imported


def test_only_once_cann_is_present_is_torch_npu_imported_and_a_failure_to_load_is_explained(machine, tmp_path):
    machine.package("torch_npu")
    cann = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    cann.mkdir(parents=True)
    found = machine.detect(ASCEND_HOME_PATH=str(cann))
    assert machine.vendor_package_was_imported
    assert found["ascend"]["available"] is False
    assert found["ascend"]["reason"] == (f"torch_npu failed to load with CANN at ASCEND_HOME_PATH={cann}: "
                                         "ImportError: devshim must not import torch_npu here")


# -- Sophgo vs Google's torch_tpu ------------------------------------------------------------------


def test_googles_torch_tpu_is_recognised_by_its_files_and_not_imported(machine):
    machine.package("torch_tpu", "_loader.py", "_internal/")
    found = machine.detect()
    assert found["sophgo"]["available"] is False
    assert found["sophgo"]["reason"] == ("the installed torch_tpu is Google's TorchTPU (PyPI torch-tpu), not "
                                         "Sophgo's; devshim will not import it")
    assert found["imported"] == [] and not machine.vendor_package_was_imported


def test_googles_torch_tpu_is_recognised_by_its_distribution_metadata_too(machine):
    machine.package("torch_tpu")
    write_distribution(machine.site, "torch-tpu", "0.1.0", {}, summary="PyTorch on Cloud TPUs", author="Google LLC",
                       top_level="torch_tpu")
    found = machine.detect()
    assert "Google's TorchTPU" in found["sophgo"]["reason"]
    assert not machine.vendor_package_was_imported


def test_sophgos_torch_tpu_is_recognised_by_its_layout_and_not_imported(machine):
    machine.package("torch_tpu", "tpu/__init__.py", "lib/libtpudnn.so")
    found = machine.detect()
    assert found["sophgo"]["found"] is True
    assert found["sophgo"]["found_reason"] == "Sophgo torch_tpu found"
    assert found["sophgo"]["available"] is False  # this release detects, it does not drive the TPU
    assert found["sophgo"]["reason"] == ("Sophgo torch_tpu found, but devshim-sophgo 0.1 only detects TPUs; it does "
                                         "not drive them yet")
    assert found["imported"] == [] and not machine.vendor_package_was_imported


def test_sophgos_torch_tpu_is_recognised_by_its_distribution_metadata(machine):
    machine.package("torch_tpu")
    write_distribution(machine.site, "torch-tpu", "2.1.0", {}, summary="Sophgo TPU backend for PyTorch",
                       author="SOPHGO", top_level="torch_tpu")
    found = machine.detect(CHIP_ARCH="SG2260")
    assert found["sophgo"]["found_reason"] == "Sophgo torch_tpu found for sg2260"
    assert not machine.vendor_package_was_imported


def test_an_unknown_chip_arch_is_named_in_the_reason(machine):
    machine.package("torch_tpu", "tpu/__init__.py", "lib/libtpudnn.so")
    found = machine.detect(CHIP_ARCH="h100")
    assert found["sophgo"]["found"] is False
    assert found["sophgo"]["reason"] == ("CHIP_ARCH='h100' is not a Sophgo chip devshim knows "
                                         "(sg2260, bm1684x, sg2260e, bm1686)")


def test_a_torch_tpu_that_cannot_be_identified_is_left_alone(machine):
    package = machine.package("torch_tpu", "tpu/__init__.py")  # no lib/libtpudnn: not enough to tell
    found = machine.detect()
    assert found["sophgo"]["available"] is False
    assert found["sophgo"]["reason"] == (f"a torch_tpu package is installed at {[str(package)]} but it cannot be "
                                         "identified as Sophgo's (no Sophgo metadata, no tpu/ and lib/libtpudnn "
                                         "files); devshim will not import it")
    assert not machine.vendor_package_was_imported
