"""Spec: the vendor plugins' ``devshim_runtime_versions`` read each version from the file or metadata the vendor
ships it in (each one written here to a temporary directory, in the vendor's format), leave out what is not there,
and ``devshim info`` reports a plugin's bad answer instead of crashing."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
from pathlib import Path

import pytest
from devshim_ascend import versions as ascend
from devshim_emulation import SDK_PATH
from devshim_sophgo import versions as sophgo
from plugin_fixtures import FakePlugin, write_distribution

from devshim_core import DeviceReport, hookimpl, host_report
from devshim_core.plugins import PluginRecord, PluginRegistry

# what Ascend's install guides show `cat .../ascend_toolkit_install.info` print
TOOLKIT_INFO = """package_name=Ascend-cann-toolkit
version=8.0.RC1
innerversion=V100R001C17SPC001B240
compatible_version=[V100R001C15,V100R001C18],[V100R001C30],[V100R001C13],[V100R003C11],[V100R001C29],[V100R001C10]
arch=aarch64
os=linux
path=/usr/local/Ascend/ascend-toolkit/8.0.RC1/aarch64-linux
"""
VERSION_CFG = """runtime_running_version=[7.3.0.1.231:8.0.RC2]
compiler_running_version=[7.3.0.1.231:8.0.RC2]
hccl_running_version=[7.3.0.1.231:8.0.RC2]
toolkit_running_version=[7.3.0.1.231:8.0.RC2]
"""
DRIVER_INFO = "Version=24.1.rc2\nascendhal_version=7.35.19\naicpu_version=1.0\n"


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A directory importlib.metadata searches first."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    importlib.invalidate_caches()
    return path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- Ascend ----------------------------------------------------------------------------------------


def test_cann_version_comes_from_the_toolkits_install_info_for_this_architecture(tmp_path):
    home = tmp_path / "ascend-toolkit" / "latest"
    write(home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info", TOOLKIT_INFO)
    write(home / "version.cfg", VERSION_CFG.replace("8.0.RC2", "7.0.0"))  # the install info wins
    assert ascend.cann_version({"ASCEND_HOME_PATH": str(home)}) == "8.0.RC1"


def test_cann_version_comes_from_version_cfg_when_there_is_no_install_info(tmp_path):
    home = tmp_path / "latest"
    write(home / "version.cfg", VERSION_CFG)
    assert ascend.cann_version({"ASCEND_TOOLKIT_HOME": str(home)}) == "8.0.RC2"


def test_cann_version_comes_from_version_info_last(tmp_path):
    home = tmp_path / "latest"
    write(home / "version.info", "Version=8.1.RC1\n")
    assert ascend.cann_version({"ASCEND_HOME_PATH": str(home)}) == "8.1.RC1"


def test_cann_version_is_left_out_without_a_toolkit_or_a_version_file(tmp_path):
    (tmp_path / "empty").mkdir()
    assert ascend.cann_version({}) is None
    assert ascend.cann_version({"ASCEND_HOME_PATH": str(tmp_path / "gone")}) is None
    assert ascend.cann_version({"ASCEND_HOME_PATH": str(tmp_path / "empty")}) is None


def test_the_emulated_cann_toolkit_has_a_version_the_hook_reads():
    """``DEVSHIM_EMULATE=ascend`` points ASCEND_HOME_PATH at the simulated SDK's cann/, whose version.info says
    what it is: ``devshim info`` shows it instead of a made-up CANN release."""
    assert ascend.cann_version({"ASCEND_HOME_PATH": str(SDK_PATH / "cann")}) == "emulated-by-devshim"


def test_driver_version_comes_from_the_driver_install_path_named_in_etc_ascend_install_info(tmp_path):
    install = tmp_path / "opt" / "Ascend"
    write(install / "driver" / "version.info", DRIVER_INFO)
    info = write(tmp_path / "etc" / "ascend_install.info",
                 f"UserName=HwHiAiUser\nUserGroup=HwHiAiUser\nDriver_Install_Type=full\n"
                 f"Driver_Install_Path_Param={install}\n")
    assert ascend.driver_version(info, tmp_path / "default") == "24.1.rc2"


def test_driver_version_comes_from_the_default_install_path(tmp_path):
    write(tmp_path / "Ascend" / "driver" / "version.info", DRIVER_INFO)
    assert ascend.driver_version(tmp_path / "no-install-info", tmp_path / "Ascend") == "24.1.rc2"
    assert ascend.driver_version(tmp_path / "no-install-info", tmp_path / "elsewhere") is None


def test_torch_npu_version_comes_from_its_distribution_metadata(site):
    write_distribution(site, "torch-npu", "2.13.0.post2", {}, top_level="torch_npu")
    importlib.invalidate_caches()
    assert ascend.torch_npu_version() == "2.13.0.post2"


def test_the_ascend_hook_names_each_version_it_read_and_leaves_out_the_rest(tmp_path, site, monkeypatch):
    home = tmp_path / "toolkit"
    write(home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info", TOOLKIT_INFO)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    monkeypatch.setattr(ascend, "INSTALL_INFO", tmp_path / "none")
    monkeypatch.setattr(ascend, "DEFAULT_INSTALL_PATH", tmp_path / "none")
    write_distribution(site, "torch-npu", "2.13.0", {}, top_level="torch_npu")
    importlib.invalidate_caches()
    import devshim_ascend

    report = DeviceReport(available=True, reason="", device_type="npu", device_count=1)
    assert devshim_ascend.devshim_runtime_versions(report) == {"CANN": "8.0.RC1", "torch_npu": "2.13.0"}


# -- Sophgo ----------------------------------------------------------------------------------------


def test_sophgo_driver_version_comes_from_libsophons_proc_entry(tmp_path):
    entry = write(tmp_path / "driver_version", "release version:0.5.1   release date: 20240717-103602\n")
    assert sophgo.driver_version(entry) == "0.5.1"
    assert sophgo.driver_version(write(tmp_path / "other", "something else\n")) is None
    assert sophgo.driver_version(tmp_path / "absent") is None


def test_sophgo_driver_date_comes_from_the_sg2260_drivers_proc_entry(tmp_path):
    assert sophgo.driver_date(write(tmp_path / "driver_date", "20240925\n")) == "20240925"
    assert sophgo.driver_date(tmp_path / "absent") is None


def test_libsophon_version_comes_from_the_current_links_target(tmp_path):
    (tmp_path / "libsophon-0.5.1").mkdir()
    link = tmp_path / "libsophon-current"
    link.symlink_to(tmp_path / "libsophon-0.5.1")
    assert sophgo.libsophon_version(link) == "0.5.1"
    other = tmp_path / "other-link"
    other.symlink_to(tmp_path)
    assert sophgo.libsophon_version(other) is None
    assert sophgo.libsophon_version(tmp_path / "absent") is None


def test_the_tpu_backend_version_is_parsed_from_torch_tpus_versions_file_without_importing_it(tmp_path):
    package = tmp_path / "torch_tpu"
    write(package / "tpu" / "_versions.py", "# these version variables will be replaced in build\n\n"
                                            "TPU_TRAIN_VERSION = '2.8.0.post1'\nBACKEND_VERSION = 'a1b2c3d'\n"
                                            "raise SystemExit('imported')\n")
    assert sophgo.backend_version(package) == "a1b2c3d"
    write(package / "tpu" / "_versions.py", "TPU_TRAIN_VERSION = None\nBACKEND_VERSION = None\n")  # a checkout
    assert sophgo.backend_version(package) is None
    assert sophgo.backend_version(tmp_path / "nothing") is None


def test_torch_tpu_version_comes_from_its_distribution_metadata(site):
    write_distribution(site, "torch_tpu", "2.8.0.post1", {}, author="sophgo", top_level="torch_tpu")
    importlib.invalidate_caches()
    assert sophgo.torch_tpu_version() == "2.8.0.post1"


def test_the_sophgo_hook_names_each_version_it_read_and_leaves_out_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(sophgo, "BMSOPHON_DRIVER", write(tmp_path / "dv", "release version:0.5.1   release date: x\n"))
    monkeypatch.setattr(sophgo, "SGDRV_DRIVER_DATE", tmp_path / "absent")
    monkeypatch.setattr(sophgo, "LIBSOPHON_CURRENT", tmp_path / "absent")
    monkeypatch.setattr(sophgo, "torch_tpu_version", lambda: "2.8.0")
    monkeypatch.setattr(sophgo, "backend_version", lambda: None)
    import devshim_sophgo

    report = DeviceReport(available=True, reason="", device_type="tpu", device_count=1)
    assert devshim_sophgo.devshim_runtime_versions(report) == {"torch_tpu": "2.8.0", "driver": "0.5.1"}


# -- devshim info's checks on the answer ---------------------------------------------------------------


class Answers(FakePlugin):
    def __init__(self, answer) -> None:
        super().__init__()
        self.answer = answer

    @hookimpl
    def devshim_runtime_versions(self, report: DeviceReport):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def ask(plugin) -> dict:
    registry = PluginRegistry()
    record = PluginRecord(name="acme", entry_point="<in-process>")
    registry.add(record, lambda: plugin)
    registry.detect(record)
    return host_report.runtime_versions(registry, record)


def test_a_plugins_versions_are_reported_as_it_gives_them():
    assert ask(Answers({"firmware": "1.2", "runtime": "3.4"})) == {
        "plugin": "acme", "versions": {"firmware": "1.2", "runtime": "3.4"}, "error": None}
    assert ask(Answers(None)) == {"plugin": "acme", "versions": {}, "error": None}
    assert ask(FakePlugin()) == {"plugin": "acme", "versions": {}, "error": None}  # no such hook


@pytest.mark.parametrize(("answer", "error"), [
    (["8.1"], "devshim_runtime_versions returned list (['8.1']); it must return a dict of str to str, or None"),
    ({"CANN": 8.1}, "devshim_runtime_versions returned dict ({'CANN': 8.1}); it must return a dict of str to str, "
                    "or None"),
    (OSError("version.cfg unreadable"), "devshim_runtime_versions raised OSError: version.cfg unreadable"),
    (SystemExit(3), "devshim_runtime_versions raised SystemExit: 3"),
])
def test_a_bad_answer_or_a_raising_hook_is_reported_not_raised(answer, error):
    assert ask(Answers(answer)) == {"plugin": "acme", "versions": {}, "error": error}


# -- host facts ------------------------------------------------------------------------------------------


def test_memory_is_read_from_proc_meminfo(tmp_path):
    meminfo = write(tmp_path / "meminfo", "MemTotal:       24684084 kB\nMemFree:        20000000 kB\n"
                                          "MemAvailable:   24004592 kB\nBuffers:            1234 kB\n")
    assert host_report.memory_facts(meminfo) == {"total": 24684084 * 1024, "available": 24004592 * 1024}
    assert host_report.memory_facts(tmp_path / "absent") is None


def test_shm_reports_size_and_free_space_or_absent(tmp_path):
    facts = host_report.shm_facts(tmp_path)
    stats = os.statvfs(tmp_path)
    assert facts["absent"] is False and facts["size"] == stats.f_frsize * stats.f_blocks
    assert host_report.shm_facts(tmp_path / "absent") == {"path": str(tmp_path / "absent"), "absent": True}


def test_the_distro_comes_from_os_release(tmp_path):
    release = write(tmp_path / "os-release", 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n'
                                             'VERSION_ID="12"\n')
    assert host_report.os_facts(release)["distro"] == "Debian GNU/Linux 12 (bookworm)"
    assert host_report.os_facts(tmp_path / "absent")["distro"] is None
    assert host_report.os_facts(release)["kernel"] == platform.release()


def test_a_compiler_is_found_on_path_with_the_first_line_of_its_version(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    write(bin_dir / "gcc", "#!/bin/sh\necho 'gcc (Acme) 13.2.0'\necho 'Copyright'\n").chmod(0o755)
    write(bin_dir / "slowcc", f"#!/bin/sh\nexec {shutil.which('sleep')} 5\n").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CC", raising=False)
    assert host_report.compiler_facts("CC", ("cc", "gcc", "clang")) == {
        "name": "gcc", "path": str(bin_dir / "gcc"), "version": "gcc (Acme) 13.2.0"}
    monkeypatch.setenv("CC", "slowcc -O2")
    monkeypatch.setattr(host_report, "VERSION_TIMEOUT", 0.2)
    assert host_report.compiler_facts("CC", ("cc",)) == {
        "name": "slowcc", "path": str(bin_dir / "slowcc"), "version": "did not answer --version within 0.2 s"}
    assert host_report.compiler_facts("NO_SUCH_VARIABLE", ("clang",)) is None


# -- the emulator's build cache, read without building ----------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from devshim_emulation import build

    monkeypatch.setenv("DEVSHIM_CACHE_DIR", str(tmp_path / "cache"))
    return build


def test_the_emulator_is_missing_until_a_build_starts_and_nothing_is_created_by_looking(cache, tmp_path):
    facts = host_report.emulator_facts()
    assert facts == {"cache_root": str(tmp_path / "cache"), "state": "missing",
                     "directory": str(cache.build_directory()), "library": None}
    assert not (tmp_path / "cache").exists()


def test_the_emulator_is_building_while_a_process_holds_the_build_lock(cache):
    import fcntl

    directory = cache.build_directory()
    directory.mkdir(parents=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert host_report.emulator_facts()["state"] == "building"
    assert host_report.emulator_facts()["state"] == "missing"  # a lock file left by a finished or failed build


def test_the_emulator_is_built_when_its_library_is_there(cache):
    directory = cache.build_directory()
    directory.mkdir(parents=True)
    library = directory / f"{cache.module_name()}.so"
    library.write_bytes(b"")
    facts = host_report.emulator_facts()
    assert (facts["state"], facts["library"]) == ("built", str(library))
