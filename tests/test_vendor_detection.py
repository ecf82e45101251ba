"""Spec: the Ascend and Sophgo plugins say what they found, give an actionable reason for every way a vendor
install can be broken, and never import a vendor package speculatively: torch_npu only once the CANN toolkit
is seen, ``torch_tpu`` only once it is known to be Sophgo's (it is also the import name of Google's TorchTPU,
which aborts the interpreter without Google's runtime).

Two kinds of spec, both with fake vendor packages (never a real SDK); every fake records its import:
- ``Machine``: a fresh interpreter with the fakes on PYTHONPATH, asked through the installed plugins. It shows
  that refused packages stay out of ``sys.modules`` of a clean process.
- ``sdk``: ``detect()`` itself in this process, the fakes in a tmp dir on ``sys.path``. The fixture isolates
  ``sys.path``, ``sys.modules``, ``os.environ``, ``torch.npu``/``torch.tpu`` and ctypes' library search.
"""

from __future__ import annotations

import ctypes.util
import importlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from devshim_ascend.detect import NOT_INSTALLED as ASCEND_NOT_INSTALLED
from devshim_ascend.detect import detect as detect_ascend
from devshim_sophgo.detect import CHIPS
from devshim_sophgo.detect import NOT_INSTALLED as SOPHGO_NOT_INSTALLED
from devshim_sophgo.detect import detect as detect_sophgo
from plugin_fixtures import PYTHON, clean_env, run

TORCH_MINOR = ".".join(torch.__version__.split("+")[0].split(".")[:2])
OTHER_MINOR = "2.1" if TORCH_MINOR != "2.1" else "2.8"

DETECT_BOTH = """\
import json, sys
import devshim_ascend, devshim_sophgo
from devshim_ascend.detect import detect as detect_ascend
from devshim_sophgo.detect import detect as detect_sophgo
out = {}
for name, plugin, detect in (("ascend", devshim_ascend, detect_ascend), ("sophgo", devshim_sophgo, detect_sophgo)):
    report, found = plugin.devshim_detect(), detect()
    out[name] = {"available": report.available, "reason": report.reason, "device_type": report.device_type,
                 "found": found.ok, "found_reason": found.reason}
out["imported"] = sorted(m for m in ("torch_npu", "torch_tpu") if m in sys.modules)
print(json.dumps(out))
"""


def write_dist_info(site: Path, name: str, version: str, headers: list[tuple[str, str]] = (), *,
                    top_level: str, entry_points: dict[str, dict[str, str]] | None = None) -> None:
    """A ``.dist-info`` as pip leaves it: METADATA with ``headers``, top_level.txt, entry_points.txt."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    (info / "METADATA").write_text("\n".join(lines + [f"{k}: {v}" for k, v in headers]) + "\n")
    (info / "top_level.txt").write_text(f"{top_level}\n")
    if entry_points:
        sections = (f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items())
                    for group, names in entry_points.items())
        (info / "entry_points.txt").write_text("".join(sections))
    (info / "INSTALLER").write_text("devshim-tests\n")


GOOGLE_METADATA = [("Summary", "PyTorch on Cloud TPUs"), ("Author-email", "Google LLC <noreply@google.com>"),
                   ("Project-URL", "Source, https://github.com/google-pytorch/torch_tpu"),
                   ("Requires-Dist", "torch"), ("Requires-Dist", "libtpu")]
SOPHGO_METADATA = [("Summary", "TPU bridge for PyTorch"), ("Home-page", "https://github.com/sophgo/torch-tpu"),
                   ("Author", "sophgo"), ("Author-email", "dev@sophgo.com")]


class FakeSdks:
    """Fake vendor packages in one site directory; each appends its name to ``imports.log`` when imported."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.site = root / "site"
        self.site.mkdir()
        self.log = root / "imports.log"

    @property
    def imported(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def _package(self, name: str, body: str, files: tuple[str, ...] = ()) -> Path:
        package = self.site / name
        package.mkdir()
        (package / "__init__.py").write_text(f"open({str(self.log)!r}, 'a').write({name + chr(10)!r})\n{body}")
        for relative in files:
            path = package / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            if not relative.endswith("/"):
                path.write_text("")
        importlib.invalidate_caches()
        return package

    @staticmethod
    def _device_module(attribute: str, devices: int) -> str:
        return (f"import torch, types\ntorch.{attribute} = types.SimpleNamespace(is_available=lambda: {devices > 0}, "
                f"device_count=lambda: {devices})\n")

    def cann(self) -> Path:
        """A CANN toolkit directory (what set_env.sh points ASCEND_HOME_PATH at)."""
        path = self.root / "Ascend" / "ascend-toolkit" / "latest"
        path.mkdir(parents=True)
        return path

    def torch_npu(self, *, devices: int = 2, fail: str | None = None, version: str | None = None,
                  autoload_entry_point: bool = False) -> Path:
        package = self._package("torch_npu", f"raise {fail}\n" if fail else self._device_module("npu", devices))
        if version or autoload_entry_point:
            write_dist_info(self.site, "torch-npu", version or f"{TORCH_MINOR}.0", top_level="torch_npu",
                            entry_points={"torch.backends": {"torch_npu": "torch_npu:_autoload"}}
                            if autoload_entry_point else None)
        importlib.invalidate_caches()
        return package

    def sophgo_torch_tpu(self, *, devices: int = 1, fail: str | None = None, chips: tuple[str, ...] = ("sg2260",),
                         layout: bool = True, metadata_version: str | None = None,
                         chooses_chip: str | None = None) -> Path:
        """Sophgo's torch_tpu, told apart by its layout (tpu/, lib/libtpudnn.<chip>.so) and/or its metadata."""
        body = f"import os\nos.environ.setdefault('CHIP_ARCH', {chooses_chip!r})\n" if chooses_chip else ""
        body += f"raise {fail}\n" if fail else self._device_module("tpu", devices)
        files = ("tpu/__init__.py", *(f"lib/libtpudnn.{chip}.so" for chip in chips)) if layout else ()
        package = self._package("torch_tpu", body, files)
        if metadata_version:
            write_dist_info(self.site, "torch_tpu", metadata_version, SOPHGO_METADATA, top_level="torch_tpu")
        importlib.invalidate_caches()
        return package

    def google_torch_tpu(self, *, files: bool = True, metadata: bool = True) -> Path:
        """Google's TorchTPU: importing it without Google's runtime aborts the process, so the fake exits."""
        package = self._package("torch_tpu", "raise SystemExit(\"Google's TorchTPU was imported: the real one "
                                             "aborts the interpreter here\")\n",
                                ("_loader.py", "_internal/") if files else ())
        if metadata:
            write_dist_info(self.site, "torch-tpu", "0.1.0", GOOGLE_METADATA, top_level="torch_tpu",
                            entry_points={"torch.backends": {"torch_tpu": "torch_tpu:_autoload"}})
        importlib.invalidate_caches()
        return package


_VENDOR_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_RT_VISIBLE_DEVICES", "CHIP_ARCH",
               "TPU_VISIBLE_DEVICES", "TORCH_DEVICE_BACKEND_AUTOLOAD")


@pytest.fixture
def sdk(tmp_path, monkeypatch):
    """Fake SDKs importable in this process; everything they or detection touch is put back afterwards."""
    for name in _VENDOR_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # no CANN library on this host
    saved_env = dict(os.environ)
    saved_torch = {name: torch.__dict__[name] for name in ("npu", "tpu") if name in torch.__dict__}
    fakes = FakeSdks(tmp_path)
    monkeypatch.syspath_prepend(str(fakes.site))
    yield fakes
    for name in [m for m in sys.modules if m.partition(".")[0] in ("torch_npu", "torch_tpu")]:
        del sys.modules[name]
    for name in ("npu", "tpu"):
        if name in saved_torch:
            setattr(torch, name, saved_torch[name])
        else:
            torch.__dict__.pop(name, None)
    for name in set(os.environ) - set(saved_env):
        del os.environ[name]
    os.environ.update(saved_env)
    importlib.invalidate_caches()


class Machine:
    """A directory of fake vendor packages and what a fresh interpreter's plugins make of it."""

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
        found = json.loads(result.stdout)
        for vendor in ("ascend", "sophgo"):
            if not found[vendor]["found"]:  # the plugin reports what detection found
                assert found[vendor]["available"] is False
                assert found[vendor]["found_reason"] in found[vendor]["reason"]
        return found

    @property
    def vendor_package_was_imported(self) -> bool:
        return self.marker.exists()


@pytest.fixture
def machine(tmp_path) -> Machine:
    return Machine(tmp_path)


# -- in a fresh interpreter, through the installed plugins -------------------------------------------


def test_with_no_vendor_package_installed_both_report_unavailable_and_say_what_to_install(machine):
    found = machine.detect()
    assert (found["ascend"]["device_type"], found["ascend"]["found_reason"]) == ("npu", ASCEND_NOT_INSTALLED)
    assert ASCEND_NOT_INSTALLED == ("torch_npu is not installed (install Huawei's torch-npu matching your torch, "
                                    "with the CANN toolkit)")
    assert (found["sophgo"]["device_type"], found["sophgo"]["found_reason"]) == ("tpu", SOPHGO_NOT_INSTALLED)
    assert SOPHGO_NOT_INSTALLED == "Sophgo's torch_tpu is not installed (it ships with Sophgo's SDK, not PyPI)"
    assert found["imported"] == []


def test_torch_npu_without_the_cann_toolkit_is_not_imported_and_the_reason_says_how_to_set_cann_up(machine):
    machine.package("torch_npu")
    found = machine.detect()
    assert found["ascend"]["found_reason"] == (
        "torch_npu is installed but the CANN toolkit was not found (ASCEND_HOME_PATH and ASCEND_TOOLKIT_HOME are "
        "unset, no libascendcl on the library path): source CANN's set_env.sh (by default "
        "/usr/local/Ascend/ascend-toolkit/set_env.sh) or set ASCEND_HOME_PATH; without it DeepSpeed's own NPU "
        "accelerator (DS_ACCELERATOR=npu) also fails, with KeyError: 'ASCEND_HOME_PATH'")
    assert found["imported"] == [] and not machine.vendor_package_was_imported


def test_an_ascend_home_path_naming_no_directory_is_named_with_its_path_and_torch_npu_is_not_imported(machine,
                                                                                                      tmp_path):
    machine.package("torch_npu")
    stale = tmp_path / "Ascend" / "removed-toolkit"
    found = machine.detect(ASCEND_HOME_PATH=str(stale))
    assert found["ascend"]["found_reason"] == (
        f"torch_npu is installed but ASCEND_HOME_PATH={stale} names no directory (no such CANN toolkit there): "
        "point ASCEND_HOME_PATH at the installed toolkit (e.g. /usr/local/Ascend/ascend-toolkit/latest) or source "
        "CANN's set_env.sh (by default /usr/local/Ascend/ascend-toolkit/set_env.sh), which sets it")
    assert found["imported"] == [] and not machine.vendor_package_was_imported


def test_googles_torch_tpu_is_recognised_by_its_files_and_not_imported(machine):
    machine.package("torch_tpu", "_loader.py", "_internal/")
    found = machine.detect()
    assert found["sophgo"]["found_reason"].startswith(
        "the installed torch_tpu is Google's TorchTPU (PyPI torch-tpu), not Sophgo's; devshim will not import it")
    assert found["imported"] == [] and not machine.vendor_package_was_imported


def test_a_torch_tpu_that_cannot_be_identified_is_left_alone(machine):
    package = machine.package("torch_tpu", "tpu/__init__.py")  # no lib/libtpudnn: not enough to tell
    found = machine.detect()
    assert found["sophgo"]["found_reason"] == (f"a torch_tpu package is installed at {[str(package)]} but it cannot "
                                               "be identified as Sophgo's (no Sophgo metadata, no tpu/ and "
                                               "lib/libtpudnn files); devshim will not import it")
    assert found["imported"] == [] and not machine.vendor_package_was_imported


def test_an_unknown_chip_arch_is_named_with_the_valid_chips_before_anything_is_imported(machine):
    machine.package("torch_tpu", "tpu/__init__.py", "lib/libtpudnn.sg2260.so")
    found = machine.detect(CHIP_ARCH="h100")
    assert found["sophgo"]["found"] is False
    assert found["sophgo"]["found_reason"] == ("CHIP_ARCH='h100' is not a Sophgo chip devshim knows "
                                               "(sg2260, bm1684x, sg2260e, bm1686)")
    assert not machine.vendor_package_was_imported


# -- Ascend: detect() in this process ---------------------------------------------------------------


@pytest.mark.parametrize("variable", ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"])
def test_either_cann_variable_naming_no_directory_is_reported_by_name_and_path(sdk, monkeypatch, variable):
    sdk.torch_npu()
    monkeypatch.setenv(variable, "/opt/no-such-cann")
    found = detect_ascend()
    assert not found.ok
    assert f"{variable}=/opt/no-such-cann names no directory" in found.reason
    assert f"point {variable} at the installed toolkit" in found.reason
    assert sdk.imported == []


def test_a_stale_cann_variable_is_reported_even_when_libascendcl_is_found(sdk, monkeypatch):
    sdk.torch_npu()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "ascendcl.so" if name == "ascendcl" else None)
    monkeypatch.setenv("ASCEND_HOME_PATH", "/opt/old-cann")
    assert "ASCEND_HOME_PATH=/opt/old-cann names no directory" in detect_ascend().reason
    assert sdk.imported == []


def test_torch_npu_broken_without_cann_explains_that_import_torch_fails_and_how_to_switch_autoload_off(sdk):
    sdk.torch_npu(autoload_entry_point=True)
    reason = detect_ascend().reason
    assert "source CANN's set_env.sh" in reason and "KeyError: 'ASCEND_HOME_PATH'" in reason
    assert ("until then `import torch` itself fails in new processes ('Failed to load the backend extension: "
            "torch_npu', torch_npu's torch.backends entry point): set TORCH_DEVICE_BACKEND_AUTOLOAD=0") in reason
    assert sdk.imported == []


def test_the_autoload_advice_is_left_out_when_it_does_not_apply(sdk, monkeypatch):
    sdk.torch_npu()  # no torch.backends entry point (older torch_npu)
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in detect_ascend().reason
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # now the entry point is there, but autoload is off
    write_dist_info(sdk.site, "torch-npu", f"{TORCH_MINOR}.0", top_level="torch_npu",
                    entry_points={"torch.backends": {"torch_npu": "torch_npu:_autoload"}})
    importlib.invalidate_caches()
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in detect_ascend().reason
    assert sdk.imported == []


def test_with_cann_present_a_failing_torch_npu_import_is_quoted_and_a_cann_version_mismatch_named(sdk, monkeypatch):
    sdk.torch_npu(fail="ImportError('libhccl.so: cannot open shared object file: No such file or directory')")
    cann = sdk.cann()
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    found = detect_ascend()
    assert sdk.imported == ["torch_npu"]
    assert not found.ok and found.device_count == 0
    assert found.reason == (
        f"torch_npu failed to load with CANN at ASCEND_HOME_PATH={cann}: ImportError: libhccl.so: cannot open "
        "shared object file: No such file or directory; this usually means the CANN version does not match this "
        "torch-npu release (each torch-npu release supports specific CANN versions): install the CANN version "
        "your torch-npu requires and source CANN's set_env.sh (by default /usr/local/Ascend/ascend-toolkit/set_env.sh)")


def test_a_failing_import_with_the_backend_autoload_in_place_also_says_how_to_keep_torch_importable(sdk, monkeypatch):
    sdk.torch_npu(fail="RuntimeError('Failed to load the backend extension: torch_npu')", autoload_entry_point=True)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(sdk.cann()))
    reason = detect_ascend().reason
    assert "RuntimeError: Failed to load the backend extension: torch_npu" in reason
    assert "CANN version does not match" in reason and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in reason


def test_a_torch_npu_built_for_another_torch_is_named_as_the_cause(sdk, monkeypatch):
    sdk.torch_npu(fail="ImportError('undefined symbol: _ZN3c10')", version=f"{OTHER_MINOR}.0.post3")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(sdk.cann()))
    reason = detect_ascend().reason
    assert "ImportError: undefined symbol: _ZN3c10" in reason
    assert (f"torch-npu {OTHER_MINOR}.0.post3 is built for torch {OTHER_MINOR} but torch "
            f"{importlib.metadata.version('torch')} is installed") in reason


def test_the_cann_library_on_the_library_path_is_enough_to_load_torch_npu(sdk, monkeypatch):
    sdk.torch_npu(devices=8)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "ascendcl.so" if name == "ascendcl" else None)
    assert detect_ascend() == (True, "8 Ascend NPUs (torch_npu, CANN at libascendcl.so)", 8)


def test_torch_npu_that_sees_no_npu_points_at_the_visible_devices_variable_and_the_driver(sdk, monkeypatch):
    sdk.torch_npu(devices=0)
    cann = sdk.cann()
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    found = detect_ascend()
    assert found == (False, f"torch_npu and CANN (ASCEND_HOME_PATH={cann}) are installed but no NPU is visible "
                            "(ASCEND_RT_VISIBLE_DEVICES='' may hide them; check the driver with npu-smi info)", 0)


def test_a_driver_error_while_counting_npus_is_quoted(sdk, monkeypatch):
    sdk._package("torch_npu", "import torch, types\ndef _fail():\n    raise RuntimeError('drvErr 87')\n"
                              "torch.npu = types.SimpleNamespace(is_available=_fail)\n")
    cann = sdk.cann()
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    assert detect_ascend().reason == (f"torch_npu loaded (CANN at ASCEND_HOME_PATH={cann}) but asking it for NPUs "
                                      "failed: RuntimeError: drvErr 87; check the Ascend driver and firmware "
                                      "(npu-smi info)")


def test_with_cann_and_npus_present_the_count_is_reported(sdk, monkeypatch):
    sdk.torch_npu(devices=2)
    cann = sdk.cann()
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    found = detect_ascend()
    assert (found.ok, found.device_count) == (True, 2)
    assert found.reason == f"2 Ascend NPUs (torch_npu, CANN at ASCEND_HOME_PATH={cann})"


def test_a_torch_npu_that_torch_already_loaded_is_not_held_back_by_the_cann_checks(sdk):
    sdk.torch_npu(devices=1)
    importlib.import_module("torch_npu")  # what torch's backend autoload does when CANN works
    assert detect_ascend() == (True, "1 Ascend NPUs (torch_npu, CANN at an unknown place (torch_npu was imported "
                                     "before devshim looked))", 1)


# -- Sophgo: detect() in this process ---------------------------------------------------------------


@pytest.mark.parametrize(("files", "metadata"), [(True, False), (False, True), (True, True)],
                         ids=["by-files", "by-metadata", "by-both"])
def test_googles_torch_tpu_is_refused_by_files_or_metadata_and_never_imported(sdk, files, metadata):
    sdk.google_torch_tpu(files=files, metadata=metadata)
    found = detect_sophgo()
    assert not found.ok
    assert found.reason == (
        "the installed torch_tpu is Google's TorchTPU (PyPI torch-tpu), not Sophgo's; devshim will not import it "
        "(without Google's TPU runtime importing it aborts the process, and torch loads it on `import torch` unless "
        "TORCH_DEVICE_BACKEND_AUTOLOAD=0). For a Sophgo TPU: pip uninstall torch-tpu, then install Sophgo's "
        "torch_tpu from its SDK")
    assert sdk.imported == [] and "torch_tpu" not in sys.modules


def test_googles_and_sophgos_distributions_both_claiming_torch_tpu_are_refused(sdk):
    sdk.google_torch_tpu(files=False, metadata=True)
    write_dist_info(sdk.site, "sophgo-torch-tpu", "2.8.0.post1", SOPHGO_METADATA, top_level="torch_tpu")
    importlib.invalidate_caches()
    reason = detect_sophgo().reason
    assert reason.startswith("two distributions provide the torch_tpu package, Google's TorchTPU")
    assert "pip uninstall torch-tpu" in reason
    assert sdk.imported == []


@pytest.mark.parametrize(("layout", "metadata_version"), [(True, None), (False, f"{TORCH_MINOR}.0.post1")],
                         ids=["by-layout", "by-metadata"])
def test_sophgos_torch_tpu_once_identified_is_imported_and_its_tpus_counted(sdk, monkeypatch, layout,
                                                                            metadata_version):
    sdk.sophgo_torch_tpu(devices=4, layout=layout, metadata_version=metadata_version)
    monkeypatch.setenv("CHIP_ARCH", "SG2260")
    found = detect_sophgo()
    assert found == (True, "4 Sophgo TPUs on sg2260 (torch_tpu)", 4, "sg2260")
    assert sdk.imported == ["torch_tpu"]


def test_the_chip_torch_tpu_chose_itself_is_reported(sdk):
    sdk.sophgo_torch_tpu(devices=1, chips=("sg2260", "bm1684x"), chooses_chip="bm1684x")
    found = detect_sophgo()
    assert (found.ok, found.chip, found.device_count) == (True, "bm1684x", 1)
    assert found.reason == "1 Sophgo TPUs on bm1684x (torch_tpu)"


def test_an_unknown_chip_arch_lists_the_valid_chips(sdk, monkeypatch):
    sdk.sophgo_torch_tpu()
    monkeypatch.setenv("CHIP_ARCH", "h100")
    assert detect_sophgo() == (False, f"CHIP_ARCH='h100' is not a Sophgo chip devshim knows ({', '.join(CHIPS)})",
                               0, "")
    assert sdk.imported == []


def test_a_chip_arch_this_build_has_no_kernels_for_is_reported_before_import(sdk, monkeypatch):
    package = sdk.sophgo_torch_tpu(chips=("sg2260",))
    monkeypatch.setenv("CHIP_ARCH", "bm1684x")
    found = detect_sophgo()
    assert found.reason == (f"CHIP_ARCH=bm1684x but this torch_tpu ({package}) ships no lib/libtpudnn.bm1684x.so "
                            "(it is built for sg2260): set CHIP_ARCH to one of those, unset it to let torch_tpu "
                            "choose, or install a torch_tpu built for bm1684x")
    assert sdk.imported == []


def test_sophgos_torch_tpu_that_fails_to_load_is_quoted_with_what_to_check(sdk, monkeypatch):
    sdk.sophgo_torch_tpu(fail="OSError('libtpurt.sg2260.so: cannot open shared object file')")
    monkeypatch.setenv("CHIP_ARCH", "sg2260")
    found = detect_sophgo()
    assert sdk.imported == ["torch_tpu"]
    assert (found.ok, found.chip) == (False, "sg2260")
    assert found.reason == (
        "Sophgo's torch_tpu failed to load: OSError: libtpurt.sg2260.so: cannot open shared object file; "
        "CHIP_ARCH=sg2260 loads lib/libtpudnn.sg2260.so and libtpurt.sg2260.so: set CHIP_ARCH to your chip "
        f"({', '.join(CHIPS)}), check that the Sophgo driver and runtime are installed, and that this torch_tpu was "
        "built for the installed torch")


def test_sophgos_torch_tpu_built_for_another_torch_is_named_as_the_cause(sdk):
    sdk.sophgo_torch_tpu(fail="ImportError('undefined symbol: _ZN2at4_ops')", metadata_version=f"{OTHER_MINOR}.0.post1")
    reason = detect_sophgo().reason
    assert reason.startswith("Sophgo's torch_tpu failed to load: ImportError: undefined symbol: _ZN2at4_ops; ")
    assert (f"torch_tpu {OTHER_MINOR}.0.post1 is built for torch {OTHER_MINOR} but torch "
            f"{importlib.metadata.version('torch')} is installed") in reason


def test_a_torch_tpu_that_registers_no_torch_tpu_module_is_reported(sdk):
    sdk._package("torch_tpu", "", ("tpu/__init__.py", "lib/libtpudnn.sg2260.so"))  # loads, sets no torch.tpu
    found = detect_sophgo()
    assert found.reason == ("Sophgo's torch_tpu loaded but asking it for TPUs failed: AttributeError: module 'torch' "
                            "has no attribute 'tpu'; check the Sophgo driver and CHIP_ARCH")
    assert sdk.imported == ["torch_tpu"]


def test_sophgos_torch_tpu_with_no_tpu_points_at_the_visible_devices_and_the_chip(sdk, monkeypatch):
    sdk.sophgo_torch_tpu(devices=0)
    monkeypatch.setenv("TPU_VISIBLE_DEVICES", "7")
    found = detect_sophgo()
    assert found == (False, "Sophgo's torch_tpu loaded but no TPU is visible (TPU_VISIBLE_DEVICES='7' may hide "
                            "them, that CHIP_ARCH names the installed chip, and the Sophgo driver)", 0, "")


# -- both vendors on one machine ---------------------------------------------------------------------


def test_with_both_vendors_installed_each_plugin_detects_its_own(sdk, monkeypatch):
    sdk.torch_npu(devices=2)
    sdk.sophgo_torch_tpu(devices=1)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(sdk.cann()))
    monkeypatch.setenv("CHIP_ARCH", "sg2260")
    ascend, sophgo = detect_ascend(), detect_sophgo()
    assert (ascend.ok, ascend.device_count) == (True, 2)
    assert (sophgo.ok, sophgo.device_count, sophgo.chip) == (True, 1, "sg2260")
    assert sorted(sdk.imported) == ["torch_npu", "torch_tpu"]
    assert detect_sophgo() == sophgo and detect_ascend() == ascend  # asking again changes nothing


def test_a_broken_vendor_does_not_hide_the_other(sdk, monkeypatch):
    sdk.torch_npu(devices=2)
    sdk.google_torch_tpu()
    monkeypatch.setenv("ASCEND_HOME_PATH", str(sdk.cann()))
    assert detect_sophgo().reason.startswith("the installed torch_tpu is Google's TorchTPU")
    assert detect_ascend().ok
    assert sdk.imported == ["torch_npu"]
