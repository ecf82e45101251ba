"""Spec: ``devshim info`` and ``devshim plugins`` say what was detected, what was chosen and why, what was patched,
and the host under it all (``ds_report``'s and ``accelerate env``'s facts); ``devshim --version`` lists the installed
devshim distributions.

``info`` activates devshim as ``import devshim_core.auto`` would, so every command runs in a subprocess.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import textwrap

import pytest
from plugin_fixtures import (
    DEVSHIM_SCRIPT,
    INSTALLED_PLUGINS,
    PYTHON,
    TESTS_DIR,
    Background,
    checked_json,
    clean_env,
    run,
    write_distribution,
)

TOP_LEVEL_KEYS = {"selected", "reason", "plugins", "patches"}
PLUGIN_KEYS = {"name", "distribution", "version", "available", "reason", "priority", "device_type", "device_count"}

COMMANDS = {
    "info --json": ([DEVSHIM_SCRIPT, "info", "--json"], clean_env()),
    "plugins --json": ([DEVSHIM_SCRIPT, "plugins", "--json"], clean_env()),
    "python -m devshim_core plugins --json": ([PYTHON, "-m", "devshim_core", "plugins", "--json"], clean_env()),
    "info, every integration off": ([DEVSHIM_SCRIPT, "info"], clean_env(
        DEVSHIM_PATCH_DEEPSPEED="0", DEVSHIM_REDIRECT_CUDA="0", DEVSHIM_PATCH_MEGATRON="0",
        DEVSHIM_PATCH_DISTRIBUTED="0")),
    "plugins, DEVSHIM_PLUGIN=nvidia": ([DEVSHIM_SCRIPT, "plugins"], clean_env(DEVSHIM_PLUGIN="nvidia")),
    "info --json, DEVSHIM_PLUGIN=nvidia": ([DEVSHIM_SCRIPT, "info", "--json"], clean_env(DEVSHIM_PLUGIN="nvidia")),
    "plugins --json, DEVSHIM_PATCH_DEEPSPEED=maybe": ([DEVSHIM_SCRIPT, "plugins", "--json"],
                                                      clean_env(DEVSHIM_PATCH_DEEPSPEED="maybe")),
    "info --json, DS_ACCELERATOR=cuda": ([DEVSHIM_SCRIPT, "info", "--json"], clean_env(DS_ACCELERATOR="cuda")),
    "--version": ([DEVSHIM_SCRIPT, "--version"], clean_env()),
    "--version imports": ([PYTHON, "-c", "import sys\nfrom devshim_core.cli import main\ntry:\n"
                                         "    main(['--version'])\nexcept SystemExit as exc:\n"
                                         "    print('exit', exc.code, 'torch' in sys.modules)"], clean_env()),
}


@pytest.fixture(scope="module")
def cli():
    """Every command of this module, started together in subprocesses."""
    commands = Background(COMMANDS)
    yield commands
    commands.close()


@pytest.fixture(scope="module")
def info(cli) -> dict:
    return checked_json(cli["info --json"])


@pytest.fixture(scope="module")
def plugins(cli) -> dict:
    return checked_json(cli["plugins --json"])


def assert_lists_every_installed_plugin(report: dict) -> dict[str, dict]:
    by_name = {p["name"]: p for p in report["plugins"]}
    assert set(by_name) == set(INSTALLED_PLUGINS)
    for name, plugin in by_name.items():
        assert set(plugin) >= PLUGIN_KEYS, plugin
        assert plugin["distribution"] == f"devshim-{name.replace('_', '-')}"
        assert plugin["version"] == "0.1.0"
        assert isinstance(plugin["reason"], str) and plugin["reason"]
    assert by_name["cpu_reference"] | {"reason": None} == {  # its reason depends on the environment
        "name": "cpu_reference", "distribution": "devshim-cpu-reference", "version": "0.1.0",
        "entry_point": "devshim_cpu_reference", "available": True, "reason": None, "priority": -1000,
        "device_type": "cpu", "device_count": 1, "error": None}
    assert (by_name["ascend"]["available"], by_name["ascend"]["device_type"], by_name["ascend"]["priority"]) == (
        False, "npu", 100)
    assert by_name["ascend"]["reason"].startswith("not available: torch_npu is not installed")
    assert (by_name["sophgo"]["available"], by_name["sophgo"]["device_type"]) == (False, "tpu")
    return by_name


# -- devshim info --------------------------------------------------------------------------------


def test_info_json_reports_the_selection_the_plugins_and_the_patches(info):
    assert set(info) >= TOP_LEVEL_KEYS
    assert info["selected"] == "cpu_reference"
    assert info["reason"] == "the only available plugin"
    assert_lists_every_installed_plugin(info)


def test_info_says_that_deepspeeds_own_accelerator_choice_is_overridden(cli):
    report = checked_json(cli["info --json, DS_ACCELERATOR=cuda"])
    assert report["integrations"]["deepspeed"].endswith("; DS_ACCELERATOR=cuda is ignored (devshim's accelerator is "
                                                        "used)")
    assert {p["name"] for p in report["patches"] if p["set"] == "deepspeed"} == {"accelerator",
                                                                                "stale-accelerator-references"}


def test_info_shows_the_deepspeed_patches_applied_with_target_reason_and_detail(info):
    assert info["integrations"]["deepspeed"] == "applied when deepspeed is imported, before its op builders are bound"
    patches = {p["name"]: p for p in info["patches"]}
    assert set(patches) >= {"accelerator", "stale-accelerator-references"}
    accelerator = patches["accelerator"]
    assert accelerator["set"] == "deepspeed"
    assert accelerator["target"] == "deepspeed.accelerator.real_accelerator:ds_accelerator"
    assert accelerator["detail"] == "deepspeed.accelerator.real_accelerator:ds_accelerator set"
    assert "get_accelerator()" in accelerator["reason"]
    assert accelerator["requires"] == {"deepspeed": ">=0.16,<0.20"}
    assert accelerator["versions"] == {"deepspeed": "0.19.8"}
    for patch in info["patches"]:
        assert patch["target"] and patch["reason"] and patch["detail"], patch


def test_info_describes_the_device_and_the_versions(info):
    assert info["device"]["plugin"] == "cpu_reference"
    assert info["device"]["device_type"] == "cpu"
    assert info["device"]["backend"] == "gloo"
    assert {"python", "devshim-core", "torch", "deepspeed"} <= set(info["versions"])
    assert info["versions"]["devshim-core"] == "0.1.0"
    # the supported ranges, as the patch sets declare them (one place each)
    assert info["supported"] == {"deepspeed": ">=0.16,<0.20", "megatron-core": ">=0.12.1,<0.17"}


def test_info_says_where_the_kernels_come_from_and_which_adam_implementation_runs(info):
    import devshim_kernels
    import devshim_kernels.file_io

    sources = info["device"]["kernel_sources"]
    assert sources == {"optimizer": f"fused_adamw: devshim_kernels; host Adam: devshim_kernels, "
                                    f"{devshim_kernels.implementation()}",
                       "attention": "devshim_kernels"}
    assert info["device"]["offload_io"] == {"file_io": True, "source": devshim_kernels.file_io.describe()}


def test_info_in_text_form_with_every_integration_switched_off_says_so_and_patches_nothing(cli):
    result = cli["info, every integration off"]
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "selected: cpu_reference\n  why: the only available plugin" in out
    assert "deepspeed      skipped: DEVSHIM_PATCH_DEEPSPEED=0" in out
    assert "cuda-redirect  skipped: DEVSHIM_REDIRECT_CUDA=0" in out
    assert "megatron       skipped: DEVSHIM_PATCH_MEGATRON=0" in out
    assert "distributed    skipped: DEVSHIM_PATCH_DISTRIBUTED=0" in out
    assert out.rstrip().endswith("patches:\n  none")


# -- the host ------------------------------------------------------------------------------------


def test_info_json_reports_the_host_os_cpus_memory_and_shared_memory(info):
    host = info["host"]
    assert set(host) == {"os", "cpus", "memory", "shm", "c_compiler", "cxx_compiler", "ninja", "emulator", "runtime"}
    assert host["os"]["system"] == platform.system() and host["os"]["kernel"] == platform.release()
    assert host["os"]["machine"] == platform.machine() and host["os"]["platform"] == platform.platform()
    with open("/etc/os-release") as release:
        pretty = next(line for line in release if line.startswith("PRETTY_NAME="))
    assert host["os"]["distro"] == pretty.partition("=")[2].strip().strip('"')
    assert host["cpus"] == {"count": os.cpu_count(), "usable": len(os.sched_getaffinity(0))}
    with open("/proc/meminfo") as meminfo:
        total_kb = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
    assert host["memory"]["total"] == total_kb * 1024 and 0 < host["memory"]["available"] <= total_kb * 1024
    stats = os.statvfs("/dev/shm")
    assert host["shm"]["path"] == "/dev/shm" and host["shm"]["size"] == stats.f_frsize * stats.f_blocks
    assert 0 <= host["shm"]["free"] <= host["shm"]["size"]


def test_info_json_names_the_compilers_and_ninja_the_native_builds_use(info):
    host = info["host"]
    cc = next(name for name in ("cc", "gcc", "clang") if shutil.which(name))
    first_line = subprocess.run([shutil.which(cc), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    assert host["c_compiler"] == {"name": cc, "path": shutil.which(cc), "version": first_line.strip()}
    assert host["cxx_compiler"]["path"] == shutil.which(host["cxx_compiler"]["name"])
    assert host["ninja"]["available"] is True
    assert host["ninja"]["binary"] == shutil.which("ninja")


def test_info_json_says_where_the_emulator_is_built_and_whether_it_is(info):
    from devshim_emulation import build

    emulator = info["host"]["emulator"]
    assert emulator["cache_root"] == str(build.cache_root())
    assert emulator["directory"] == str(build.build_directory())
    assert emulator["state"] in ("built", "building", "missing")
    assert (emulator["library"] is not None) == (emulator["state"] == "built")


def test_info_json_reports_the_selected_plugins_runtime_versions(info):
    runtime = info["host"]["runtime"]
    assert runtime["plugin"] == "cpu_reference" and runtime["error"] is None
    assert isinstance(runtime["versions"], dict)


def test_info_in_text_form_has_a_host_section(cli):
    out = cli["info, every integration off"].stdout
    host = out[out.index("\nhost:\n"):out.index("\nplugins:\n")]
    assert f"  os             {platform.system()} {platform.release()} {platform.machine()}, " in host
    assert f"  cpus           {os.cpu_count()}" in host
    assert "  memory         " in host and " GiB total, " in host and " available" in host
    assert "  /dev/shm       " in host and " free" in host
    assert f"  C compiler     {shutil.which('cc')}: " in host
    assert f"  ninja          {shutil.which('ninja')}" in host
    assert "  emulator       " in host and "/emulation/torch-" in host
    assert "  runtime        (cpu_reference) " in host


def test_a_plugins_bad_runtime_versions_answer_is_reported_in_info_not_raised(tmp_path):
    """The selected plugin's devshim_runtime_versions answers a list: info says so and carries on."""
    site = tmp_path / "site"
    write_distribution(site, "acme-devshim", "1.0", {"acme": "acme_versions:plugin"}, files={
        "acme_versions.py": textwrap.dedent("""\
            from plugin_fixtures import FakePlugin
            from devshim_core import hookimpl

            class Acme(FakePlugin):
                @hookimpl
                def devshim_runtime_versions(self, report):
                    return ["1.0"]

            plugin = Acme(priority=50)
            """)})
    env = clean_env(pythonpath=[site, TESTS_DIR], DEVSHIM_PATCH_DEEPSPEED="0", DEVSHIM_PATCH_MEGATRON="0")
    report = checked_json(run([DEVSHIM_SCRIPT, "info", "--json"], env))
    assert report["selected"] == "acme"
    assert report["host"]["runtime"] == {
        "plugin": "acme", "versions": {},
        "error": "devshim_runtime_versions returned list (['1.0']); it must return a dict of str to str, or None"}
    text = run([DEVSHIM_SCRIPT, "info"], env)
    assert text.returncode == 0, text.stderr
    assert ("  runtime        (acme) error: devshim_runtime_versions returned list (['1.0']); it must return a "
            "dict of str to str, or None\n") in text.stdout


# -- devshim --version ----------------------------------------------------------------------------


def test_version_prints_devshim_core_then_each_installed_devshim_distribution_and_exits_0(cli):
    result = cli["--version"]
    assert result.returncode == 0, result.stderr
    plugins = [f"devshim-{name.replace('_', '-')} 0.1.0 (plugin {name})" for name in INSTALLED_PLUGINS]
    others = ["devshim-kernels 0.1.0", "devshim-emulation 0.1.0"]
    assert result.stdout.splitlines() == ["devshim-core 0.1.0", *sorted([*plugins, *others])]


def test_version_reads_metadata_only_without_importing_torch(cli):
    assert cli["--version imports"].stdout.splitlines()[-1] == "exit 0 False"


def test_version_lists_a_third_party_plugin_distribution_with_the_plugins_it_registers(tmp_path):
    site = tmp_path / "site"
    write_distribution(site, "acme-npu-plugin", "2.3.1", {"acme": "acme_plugin", "acme_lite": "acme_plugin:lite"})
    result = run([DEVSHIM_SCRIPT, "--version"], clean_env(pythonpath=[site]))
    assert result.returncode == 0, result.stderr
    assert "acme-npu-plugin 2.3.1 (plugins acme, acme_lite)" in result.stdout.splitlines()
    assert result.stdout.splitlines()[0] == "devshim-core 0.1.0"


# -- devshim plugins -----------------------------------------------------------------------------


def test_plugins_json_reports_discovery_and_selection_and_patches_nothing(plugins):
    assert set(plugins) >= TOP_LEVEL_KEYS
    assert (plugins["selected"], plugins["reason"]) == ("cpu_reference", "the only available plugin")
    assert plugins["patches"] == []
    assert_lists_every_installed_plugin(plugins)


def test_python_dash_m_devshim_core_is_the_same_command(cli, plugins):
    assert checked_json(cli["python -m devshim_core plugins --json"]) == plugins


# -- errors ----------------------------------------------------------------------------------------


def test_an_unknown_devshim_plugin_fails_and_lists_the_installed_plugins_with_their_reasons(cli):
    result = cli["plugins, DEVSHIM_PLUGIN=nvidia"]
    assert result.returncode == 1
    out = result.stdout
    assert "selected: none" in out
    assert "DEVSHIM_PLUGIN names 'nvidia', which is not an installed devshim plugin. Installed plugins:" in out
    for name in INSTALLED_PLUGINS:
        assert f"  - {name} (devshim-" in out
    assert "torch_npu is not installed" in out and "the host CPU is always available" in out


def test_info_with_an_unknown_devshim_plugin_fails_reports_the_error_and_patches_nothing(cli):
    report = checked_json(cli["info --json, DEVSHIM_PLUGIN=nvidia"], expect_rc=1)
    assert report["selected"] is None
    assert report["error"] == report["reason"]
    assert report["error"].startswith("DEVSHIM_PLUGIN names 'nvidia'")
    assert "  - cpu_reference (devshim-cpu-reference 0.1.0): " in report["error"]
    assert report["patches"] == []
    assert_lists_every_installed_plugin(report)


def test_a_bad_switch_value_is_a_one_line_error_with_exit_code_2_and_no_traceback(cli):
    result = cli["plugins --json, DEVSHIM_PATCH_DEEPSPEED=maybe"]
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == ("devshim: DEVSHIM_PATCH_DEEPSPEED='maybe' is not a boolean: use 1 or 0 (also accepted: "
                             "true/false, yes/no, on/off).\n")
