"""Spec: devshim never falls back in silence, and no plugin can stall it.

When an installed plugin that could have outranked the selected one is passed over (it failed to import, raised or
timed out in detection, its name is claimed twice, or its device is not available), activation prints one line on
stderr, on rank 0 only, naming each plugin passed over, why, and how to silence it or make it an error.
``DEVSHIM_REQUIRE_DEVICE=<type>`` turns a selection of another device type into an error (and, when it matches,
acknowledges the fallback). Each plugin's detection has a time limit (``DEVSHIM_DETECT_TIMEOUT``, default 10 s); a
forced plugin is the only one loaded and detected.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from plugin_fixtures import PYTHON, TESTS_DIR, FakePlugin, clean_env, run, write_distribution

from devshim_core import DeviceReport, DeviceTraits, hookimpl
from devshim_core.device import build_device
from devshim_core.errors import ConfigError, PluginError, SelectionError
from devshim_core.plugins import discover
from devshim_core.selection import select
from devshim_core.settings import DEFAULT_DETECT_TIMEOUT, Settings

OWN_VENDOR_PLUGINS = "ascend,sophgo,cuda"  # installed here, never available on this machine: kept out of the lines


def _site_with(tmp_path, name: str, module: str) -> str:
    site = tmp_path / "site"
    write_distribution(site, f"devshim-{name.replace('_', '-')}", "0.0.1", {name: module})
    return str(site)


def _activate(tmp_path, name: str, module: str, **env: str):
    environment = clean_env(pythonpath=[_site_with(tmp_path, name, module), TESTS_DIR],
                            **{"DEVSHIM_DISABLED_PLUGINS": OWN_VENDOR_PLUGINS, **env})
    return run([PYTHON, "-c", "import devshim_core.auto as a; print(a.session.selection.plugin.name)"], environment)


# -- one line on stderr ------------------------------------------------------------------------


def test_a_vendor_plugin_that_fails_to_import_is_named_on_stderr_when_the_cpu_is_used_instead(tmp_path):
    result = _activate(tmp_path, "raises_at_import", "plugin_fixtures.raises_at_import")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "cpu_reference\n"
    [line] = result.stderr.splitlines()
    assert line == ("devshim: running on cpu_reference (cpu), passing over raises_at_import (broken: failed to import: "
                    "ImportError: libvendor_runtime.so.3: cannot open shared object file). "
                    "To run on cpu and silence this, set DEVSHIM_PLUGIN=cpu_reference or DEVSHIM_REQUIRE_DEVICE=cpu "
                    "(or never load them: DEVSHIM_DISABLED_PLUGINS=raises_at_import); to make it an error, "
                    "DEVSHIM_REQUIRE_DEVICE=<the device type you expected>.")


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"DEVSHIM_PLUGIN": "cpu_reference"},
                                 {"DEVSHIM_REQUIRE_DEVICE": "cpu"},
                                 {"DEVSHIM_DISABLED_PLUGINS": f"{OWN_VENDOR_PLUGINS},raises_in_detect"}],
                         ids=["rank-1", "forced", "required-cpu", "disabled"])
def test_the_line_is_printed_by_rank_0_only_and_each_documented_switch_silences_it(tmp_path, env):
    result = _activate(tmp_path, "raises_in_detect", "plugin_fixtures.raises_in_detect", **env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "cpu_reference\n", "")


def test_devshim_require_device_turns_the_fallback_into_an_error_naming_what_was_passed_over(tmp_path):
    result = _activate(tmp_path, "raises_in_detect", "plugin_fixtures.raises_in_detect", DEVSHIM_REQUIRE_DEVICE="npu")
    assert result.returncode == 1
    assert ("devshim_core.errors.SelectionError: DEVSHIM_REQUIRE_DEVICE=npu, but the selected plugin cpu_reference "
            "runs on 'cpu'") in result.stderr
    assert "  - raises_in_detect (devshim-raises-in-detect 0.0.1): broken: detection raised OSError" in result.stderr


def test_an_unavailable_plugin_is_passed_over_loudly_only_when_it_would_have_outranked_the_choice():
    settings = Settings()
    registry = discover(settings, extra=[("npu_like", FakePlugin(priority=100, available=False,
                                                                 reason="driver not loaded")),
                                         ("chosen", FakePlugin(priority=10)),
                                         ("lower", FakePlugin(priority=5, available=False))])
    selection = select(registry, settings)
    assert selection.plugin.name == "chosen"
    assert [r.name for r in selection.passed_over if r.name in ("npu_like", "lower")] == ["npu_like"]
    assert "npu_like (not available: driver not loaded)" in selection.fallback_warning()


def test_a_forced_selection_passes_nothing_over():
    settings = Settings.from_env({"DEVSHIM_PLUGIN": "chosen"})
    registry = discover(settings, extra=[("npu_like", FakePlugin(priority=100, available=False)),
                                         ("chosen", FakePlugin(priority=10))])
    selection = select(registry, settings)
    assert selection.passed_over == () and selection.fallback_warning() is None


def test_a_required_device_type_that_the_forced_plugin_does_not_serve_is_an_error():
    settings = Settings.from_env({"DEVSHIM_PLUGIN": "chosen", "DEVSHIM_REQUIRE_DEVICE": "npu"})
    registry = discover(settings, extra=[("chosen", FakePlugin(priority=10))])
    with pytest.raises(SelectionError, match=r"^DEVSHIM_REQUIRE_DEVICE=npu, but the selected plugin chosen runs on "
                                             r"'cpu' \(forced by DEVSHIM_PLUGIN=chosen\)"):
        select(registry, settings)


@pytest.mark.parametrize("value", ["cuda:0", "n p u", "1npu"])
def test_devshim_require_device_must_be_a_device_type(value):
    with pytest.raises(ConfigError, match="is not a torch device type"):
        Settings.from_env({"DEVSHIM_REQUIRE_DEVICE": value})


# -- time limits ---------------------------------------------------------------------------------


class BlocksInDetect(FakePlugin):
    def __init__(self, release: threading.Event, **kwargs) -> None:
        super().__init__(**kwargs)
        self.release = release

    @hookimpl
    def devshim_detect(self) -> DeviceReport:
        self.release.wait(60)
        return self.report


def test_a_plugin_whose_detection_does_not_return_in_time_is_passed_over_as_timed_out():
    release = threading.Event()
    settings = Settings.from_env({"DEVSHIM_DETECT_TIMEOUT": "0.5"})
    started = time.monotonic()
    try:
        registry = discover(settings, extra=[("stuck", BlocksInDetect(release, priority=100)),
                                             ("chosen", FakePlugin(priority=10))])
    finally:
        release.set()
    assert time.monotonic() - started < 20  # the limit, plus the installed plugins' own detection
    stuck = registry.records["stuck"]
    assert stuck.error == ("detection timed out after 0.5 s (the plugin's devshim_detect did not return; raise the "
                           "limit with DEVSHIM_DETECT_TIMEOUT=<seconds>, or block the plugin with "
                           "DEVSHIM_DISABLED_PLUGINS=stuck)")
    selection = select(registry, settings)
    assert selection.plugin.name == "chosen" and stuck in selection.passed_over


def test_a_hung_plugin_does_not_hang_activation_and_a_forced_plugin_never_asks_it(tmp_path):
    started = time.monotonic()
    bounded = _activate(tmp_path, "hangs_in_detect", "plugin_fixtures.hangs_in_detect", DEVSHIM_DETECT_TIMEOUT="1")
    assert bounded.returncode == 0 and bounded.stdout == "cpu_reference\n", bounded.stderr
    assert "hangs_in_detect (broken: detection timed out after 1 s" in bounded.stderr
    forced = run([PYTHON, "-c", "import devshim_core.auto as a; print(a.session.registry.records['hangs_in_detect']"
                  ".reason)"],
                 clean_env(pythonpath=[_site_with(tmp_path / "again", "hangs_in_detect",
                                                  "plugin_fixtures.hangs_in_detect"), TESTS_DIR],
                           DEVSHIM_PLUGIN="cpu_reference"))
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout == ("not loaded: DEVSHIM_PLUGIN=cpu_reference is forced, and only it is loaded and "
                             "detected\n")
    assert time.monotonic() - started < 60  # without the limit, the first run alone would take an hour


def test_the_default_limit_is_a_few_seconds_and_0_turns_it_off():
    assert Settings.from_env({}).detect_timeout == DEFAULT_DETECT_TIMEOUT == 10.0
    assert Settings.from_env({"DEVSHIM_DETECT_TIMEOUT": "0"}).detect_timeout == 0.0


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_time_limit_that_is_not_a_number_of_seconds_is_a_config_error(value):
    with pytest.raises(ConfigError, match=rf"^DEVSHIM_DETECT_TIMEOUT='{value}' is not a number of seconds"):
        Settings.from_env({"DEVSHIM_DETECT_TIMEOUT": value})


# -- plugin answers are validated -------------------------------------------------------------------


class AnswersWith(FakePlugin):
    def __init__(self, traits: DeviceTraits, **kwargs) -> None:
        super().__init__(**kwargs)
        self.traits = traits

    @hookimpl
    def devshim_device_traits(self, report: DeviceReport) -> DeviceTraits:
        return self.traits


@pytest.mark.parametrize(("traits", "complaint"), [
    (DeviceTraits(supported_dtypes=(torch.float32,), bf16_supported="no", fp16_supported=False),
     "field bf16_supported is 'no' (str), expected a bool"),
    (DeviceTraits(supported_dtypes=(torch.float32,), bf16_supported=True, fp16_supported=1),
     "field fp16_supported is 1 (int), expected a bool"),
    (DeviceTraits(supported_dtypes=(torch.float32, "bfloat16"), bf16_supported=True, fp16_supported=False),
     "field supported_dtypes item 1 is 'bfloat16' (str), expected torch.dtype"),
    (DeviceTraits(supported_dtypes=[torch.float32], bf16_supported=True, fp16_supported=False),
     "field supported_dtypes is a list, expected a tuple"),
    (DeviceTraits(supported_dtypes=(torch.float32,), bf16_supported=True, fp16_supported=False, name=None),
     "field name is None (NoneType), expected str"),
], ids=["bool-as-str", "bool-as-int", "dtype-as-str", "list-for-tuple", "none-name"])
def test_a_field_of_the_wrong_type_stops_activation_naming_plugin_hook_and_field(traits, complaint):
    settings = Settings.from_env({"DEVSHIM_PLUGIN": "sloppy"})
    registry = discover(settings, extra=[("sloppy", AnswersWith(traits, priority=1))])
    with pytest.raises(PluginError) as excinfo:
        build_device(registry, select(registry, settings))
    assert str(excinfo.value) == f"plugin 'sloppy': devshim_device_traits returned DeviceTraits whose {complaint}."


def test_every_record_of_every_installed_plugin_passes_the_check():
    from devshim_core.record_checks import check_record

    settings = Settings.from_env({"DEVSHIM_PLUGIN": "cpu_reference"})
    registry = discover(settings)
    device = build_device(registry, select(registry, settings))
    for record in (device.traits, device.collectives, device.allocator, device.optimizer, device.attention,
                   device.offload_io, device.info.report):
        check_record(record, "cpu_reference", "test")
