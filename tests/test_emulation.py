"""Spec: device emulation is strictly opt-in, says loudly that it is not hardware, fails clearly where it cannot
work, and builds its C++ emulator once per machine, source and torch version.

Main suite: this process emulates nothing. Everything that would rename PyTorch's PrivateUse1 device runs in a
subprocess; the emulator build they share is devshim's cache (``DEVSHIM_CACHE_DIR`` if set, else
``~/.cache/devshim``), built on first use if this machine has none yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from devshim_emulation import build
from plugin_fixtures import DEVSHIM_SCRIPT, PYTHON, Background, clean_env, run

from devshim_core.errors import ConfigError
from devshim_core.settings import Settings

CACHE = str(build.cache_root())  # the machine's emulator build, shared with the emulated suites

WITHOUT_EMULATION = """\
import json, sys
import devshim_core.auto
import deepspeed
from deepspeed.accelerator import get_accelerator
import torch
acc = get_accelerator()
print(json.dumps({
    "plugin": devshim_core.auto.device.plugin,
    "emulation modules": sorted(m for m in sys.modules if m.startswith("devshim_emulation")),
    "vendor sdks": sorted(m for m in ("torch_npu", "torch_tpu") if m in sys.modules),
    "privateuse1": torch._C._get_privateuse1_backend_name(),
    "pinned": acc.pin_memory(torch.empty(10)).is_pinned(),
}))
"""

LOAD_EXTENSION = """\
import json, sys, time
import torch.utils.cpp_extension
from devshim_emulation import build

if sys.argv[1] == "no-compiling":
    def refuse(*args, **kwargs):
        raise AssertionError("load_extension compiled the emulator again")
    torch.utils.cpp_extension.load = refuse
start = time.perf_counter()
extension = build.load_extension()
elapsed = time.perf_counter() - start
library = build._built_library(build.build_directory(), build.module_name())
print(json.dumps({"file": extension.__file__, "library": str(library), "mtime_ns": library.stat().st_mtime_ns,
                  "seconds": elapsed}))
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: tmp_path_factory.mktemp(name) for name in ("unused-cache", "compilerless-cache-1",
                                                             "compilerless-cache-2")}


@pytest.fixture(scope="module")
def started(dirs: dict[str, Path]) -> Any:
    """Every subprocess of this module, started together (each pays for importing torch, most for DeepSpeed)."""
    if build._built_library(build.build_directory(), build.module_name()) is None:  # a machine's first run
        built = run([PYTHON, "-c", LOAD_EXTENSION, "may-compile"], clean_env(DEVSHIM_CACHE_DIR=CACHE), timeout=900)
        assert built.returncode == 0, built.stderr[-3000:]
    no_compiler = {"DEVSHIM_EMULATE": "ascend", "CXX": "/nonexistent/c++"}
    emulated = clean_env(DEVSHIM_EMULATE="ascend", DEVSHIM_CACHE_DIR=CACHE)
    commands = Background({
        "first load": ([PYTHON, "-c", LOAD_EXTENSION, "may-compile"], clean_env(DEVSHIM_CACHE_DIR=CACHE)),
        "emulated info": ([DEVSHIM_SCRIPT, "info"], emulated),
        "emulated info --json": ([DEVSHIM_SCRIPT, "info", "--json"], emulated),
        "without emulation": ([PYTHON, "-c", WITHOUT_EMULATION],
                              clean_env(DEVSHIM_CACHE_DIR=str(dirs["unused-cache"]))),
        "no compiler, devshim info": ([DEVSHIM_SCRIPT, "info"],
                                      clean_env(DEVSHIM_CACHE_DIR=str(dirs["compilerless-cache-1"]), **no_compiler)),
        "no compiler, import auto": ([PYTHON, "-c", "import devshim_core.auto"],
                                     clean_env(DEVSHIM_CACHE_DIR=str(dirs["compilerless-cache-2"]), **no_compiler)),
        "bogus vendor": ([DEVSHIM_SCRIPT, "info"], clean_env(DEVSHIM_EMULATE="bogus")),
    })
    yield commands
    commands.close()


@pytest.fixture(scope="module")
def loads(started: Any) -> dict[str, Any]:
    """Two fresh processes load the emulator one after the other; the second may not compile."""
    first = started["first load"]
    assert first.returncode == 0, first.stderr[-3000:]
    second = run([PYTHON, "-c", LOAD_EXTENSION, "no-compiling"], clean_env(DEVSHIM_CACHE_DIR=CACHE), timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    return {"first": json.loads(first.stdout.splitlines()[-1]), "second": json.loads(second.stdout.splitlines()[-1])}


# -- opt-in ----------------------------------------------------------------------------------------------------------

def test_without_devshim_emulate_activation_neither_imports_the_emulation_nor_builds_anything(started, dirs):
    result = started["without emulation"]
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["plugin"] == "cpu_reference"
    # only what `import torch` loads for devshim-emulation's torch.backends entry point: its lazy package and the
    # module that reads DEVSHIM_EMULATE and returns
    assert set(report["emulation modules"]) <= {"devshim_emulation", "devshim_emulation.torch_backend"}
    assert report["vendor sdks"] == []
    assert report["privateuse1"] == "privateuseone"  # PyTorch's PrivateUse1 device was left alone
    assert list(dirs["unused-cache"].iterdir()) == []


def test_on_the_cpu_plugin_deepspeeds_pin_memory_leaves_host_memory_unpinned(started):
    """The CPU has no pinned allocator: pinning is a no-op there, unlike on the vendors' devices."""
    result = started["without emulation"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1])["pinned"] is False


# -- configuration errors --------------------------------------------------------------------------------------------

def test_an_unknown_emulated_vendor_is_a_config_error_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"DEVSHIM_EMULATE='bogus' names no emulated vendor: use one of ascend, "
                                          r"sophgo"):
        Settings.from_env({"DEVSHIM_EMULATE": "bogus"})
    assert Settings.from_env({"DEVSHIM_EMULATE": "Sophgo "}).emulate == "sophgo"
    assert Settings.from_env({"DEVSHIM_EMULATE": "0"}).emulate is None


def test_devshim_info_with_an_unknown_emulated_vendor_exits_2_with_one_clear_message(started):
    result = started["bogus vendor"]
    assert result.returncode == 2
    assert result.stdout == ""
    assert ("devshim: DEVSHIM_EMULATE='bogus' names no emulated vendor: use one of ascend, sophgo (or unset it to "
            "run on real hardware).") in result.stderr.splitlines()
    assert "Traceback" not in result.stderr


COMPILER_MISSING = ("devshim's device emulation compiles a small C++ extension once per machine, and this machine "
                    "lacks: a C++ compiler ('/nonexistent/c++' is not on PATH")


def test_devshim_info_without_a_compiler_exits_2_naming_the_missing_compiler_and_builds_nothing(started, dirs):
    result = started["no compiler, devshim info"]
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout == ""
    assert result.stderr.startswith(f"devshim: {COMPILER_MISSING}")
    assert "Nothing was built; emulation stays off." in result.stderr
    assert "Traceback" not in result.stderr
    assert list(dirs["compilerless-cache-1"].rglob("*")) == []  # no build directory, no lock file, no .so


def test_import_devshim_auto_without_a_compiler_fails_with_the_build_error(started, dirs):
    result = started["no compiler, import auto"]
    assert result.returncode == 1, f"activation succeeded without the emulated device:\n{result.stderr[-2000:]}"
    assert f"devshim_emulation.build.EmulationBuildError: {COMPILER_MISSING}" in result.stderr
    assert list(dirs["compilerless-cache-2"].rglob("*.so")) == []


def test_missing_build_tools_names_the_compiler_cxx_points_at(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert any("'/nonexistent/c++' is not on PATH" in item for item in build.missing_build_tools())


# -- the emulation notice --------------------------------------------------------------------------------------------

def test_devshim_info_under_emulation_prints_the_notice_first_on_a_line_of_its_own(started):
    result = started["emulated info"]
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = result.stdout.splitlines()[:2]
    assert "EMULATED" in first and "NOT HARDWARE" in first and "DEVSHIM_EMULATE=ascend" in first
    assert second == "versions:"
    assert "selected: ascend" in result.stdout.splitlines()


def test_devshim_info_json_under_emulation_carries_the_notice(started):
    result = started["emulated info --json"]
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["selected"] == "ascend"
    assert "EMULATED" in report["emulation"] and "NOT HARDWARE" in report["emulation"]


# -- the build cache -------------------------------------------------------------------------------------------------

def test_the_build_key_follows_the_source_the_torch_version_and_the_cxx_abi(tmp_path, monkeypatch):
    source = tmp_path / "emulated_device.cpp"
    source.write_text("// version one\n")
    monkeypatch.setattr(build, "SOURCE", source)
    monkeypatch.setenv("DEVSHIM_CACHE_DIR", str(tmp_path / "cache"))
    first = build.build_key()
    assert build.build_key() == first and len(first) == 16
    source.write_text("// version two\n")
    changed_source = build.build_key()
    assert changed_source != first
    source.write_text("// version one\n")
    assert build.build_key() == first  # the content counts, not the file's time
    monkeypatch.setattr(torch, "__version__", "9.9.9+devshim.test")
    changed_torch = build.build_key()
    assert changed_torch not in (first, changed_source)
    assert build.module_name() == f"devshim_emulated_device_{changed_torch}"
    assert build.build_directory() == tmp_path / "cache" / "emulation" / "torch-9.9.9+devshim.test" / changed_torch
    monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
    assert build.build_key() not in (first, changed_source, changed_torch)


@pytest.fixture
def nothing_loaded(monkeypatch):
    """As in a fresh process: no emulator loaded, and any library import recorded instead of done."""
    imported: list[Path] = []
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setattr(build, "_import_library", lambda path, name: imported.append(path))
    return imported


def test_a_library_planted_in_a_cache_other_users_can_write_to_is_never_loaded(tmp_path, monkeypatch,
                                                                                nothing_loaded):
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("DEVSHIM_CACHE_DIR", str(shared))
    directory = build.build_directory()
    directory.mkdir(parents=True)  # as another user would have made it
    (directory / f"{build.module_name()}.so").write_bytes(b"planted")

    with pytest.raises(build.EmulationBuildError, match=r"shared-cache is writable by other users \(mode 777\)"):
        build.load_extension()
    assert nothing_loaded == []


def test_the_cache_directories_devshim_creates_are_private(tmp_path, monkeypatch, nothing_loaded):
    monkeypatch.setenv("DEVSHIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_compile", lambda directory, name: (directory / f"{name}.so").write_bytes(b"built"))
    build.load_extension()

    directory = build.build_directory()
    assert nothing_loaded == [directory / f"{build.module_name()}.so"]
    for path in (directory, *directory.parents[:3]):  # torch-<version>, emulation, the cache root
        assert path.stat().st_mode & 0o777 == 0o700, path


def test_the_build_key_of_the_shipped_source_names_the_build_directory():
    assert build.build_directory() == Path(CACHE) / "emulation" / f"torch-{torch.__version__}" / build.build_key()


def test_a_second_process_loads_the_built_emulator_without_compiling_it_again(loads):
    first, second = loads["first"], loads["second"]
    assert second["library"] == first["library"]
    assert second["file"] == first["library"]
    assert second["mtime_ns"] == first["mtime_ns"]  # the .so was not rewritten
    assert Path(first["library"]).parent == build.build_directory()
    assert os.path.basename(first["library"]).startswith(build.module_name())


LAZY_COUNT = """\
import json, os
import torch
import torch_npu
counts = [torch.npu.device_count()]
del os.environ["ASCEND_RT_VISIBLE_DEVICES"]  # as DeepSpeed's runner does before sizing the node
counts.append(torch.npu.device_count())
torch.npu.set_device(1)  # the runtime is initialized now
os.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0"
counts.append(torch.npu.device_count())
print(json.dumps(counts))
"""


def test_the_emulated_device_counts_the_visible_devices_until_the_process_first_sets_a_device(started):
    started["first load"]  # the emulator is built
    result = run([PYTHON, "-c", LAZY_COUNT], clean_env(DEVSHIM_EMULATE="ascend", DEVSHIM_EMULATE_DEVICES="2",
                                                       ASCEND_RT_VISIBLE_DEVICES="1", DEVSHIM_CACHE_DIR=CACHE))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [1, 2, 2]


# -- the emulator is a distribution of its own -----------------------------------------------------------------------

@pytest.fixture
def no_emulator_installed(monkeypatch):
    """As where devshim-core is installed without devshim-emulation: no devshim.emulation entry point."""
    from devshim_core import emulator

    monkeypatch.setattr(emulator, "_loaded", [])
    monkeypatch.setattr(emulator, "_entry_point", lambda: None)
    return emulator


def test_without_the_emulator_devshim_emulate_is_a_config_error_saying_what_to_install(no_emulator_installed):
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({"DEVSHIM_EMULATE": "ascend"})
    assert str(raised.value) == "DEVSHIM_EMULATE=ascend needs devshim's emulator: pip install ./emulation " \
                                "(devshim-emulation)"
    assert Settings.from_env({"DEVSHIM_EMULATE": "0"}).emulate is None  # off needs no emulator
    assert Settings.from_env({}).emulate is None
    assert no_emulator_installed.cache_state()["state"] == "not installed"


def test_the_core_finds_the_emulator_through_its_entry_point_only():
    """devshim-core names no module of devshim-emulation: it loads what the devshim.emulation entry point names."""
    import ast

    from plugin_fixtures import PROJECT_DIR

    from devshim_core import emulator

    named = sorted(f"{path.relative_to(PROJECT_DIR)}: {alias}"
                   for path in (PROJECT_DIR / "devshim_core").rglob("*.py")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, (ast.Import, ast.ImportFrom))
                   for alias in ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                                 [a.name for a in node.names])
                   if alias.split(".")[0] == "devshim_emulation")
    assert named == []
    assert emulator.emulator().__name__ == "devshim_emulation.hooks"
    state = emulator.cache_state()
    assert state["cache_root"] == CACHE and state["directory"] == str(build.build_directory())
    assert state["state"] in ("built", "building", "missing")
