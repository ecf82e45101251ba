"""Spec: a broken plugin is recorded with what went wrong and skipped; every other plugin keeps working.

Broken at import, raising (or exiting) in detection, answering nonsense, breaking the report's own rules,
implementing a hook devshim does not define, sharing its name with another distribution. Only once a
plugin is *selected* does breaking a later hook stop devshim, with a PluginError naming plugin and hook.
"""

from __future__ import annotations

import json

import pluggy
import pytest
from plugin_fixtures import (
    BROKEN_DISTRIBUTIONS,
    PYTHON,
    TESTS_DIR,
    DetectOnly,
    FakePlugin,
    RaisesInAllocator,
    WrongTraits,
    clean_env,
    exits_in_detect,
    install_broken_plugins,
    invalid_report,
    nonsense_detect,
    only,
    raises_in_detect,
    run,
    typo_hook,
    write_distribution,
)

from devshim_core import DeviceReport, hookimpl
from devshim_core.device import build_device
from devshim_core.errors import PluginError, SelectionError
from devshim_core.plugins import PluginRecord, discover
from devshim_core.selection import select
from devshim_core.settings import Settings


def discover_with(name: str, plugin: object, settings: Settings | None = None):
    """Discover the installed plugins plus ``plugin`` under ``name``; return the registry and its record."""
    registry = discover(settings or Settings(), extra=[(name, plugin), ("healthy", FakePlugin(priority=1))])
    return registry, registry.records[name]


def assert_broken_and_skipped(registry, record: PluginRecord, error: str) -> None:
    assert record.error is not None and record.error.startswith(error), record.error
    assert record.available is False
    assert record.reason == f"broken: {record.error}"
    assert record.as_dict()["error"] == record.error
    # ... while the other plugins were detected as usual and one of them is selected
    assert registry.records["cpu_reference"].available
    assert select(registry, Settings()).plugin.name == "healthy"


# -- detection ---------------------------------------------------------------------------------


def test_a_plugin_whose_detection_raises_is_recorded_as_broken_with_the_exception_and_its_traceback():
    registry, record = discover_with("flaky", raises_in_detect)
    assert_broken_and_skipped(registry, record, "detection raised OSError: driver /dev/vendor0 is not loaded")
    assert "Traceback" in record.error_detail and "raises_in_detect.py" in record.error_detail
    assert record.report is None


def test_a_plugin_whose_detection_calls_sys_exit_is_recorded_and_the_process_goes_on():
    registry, record = discover_with("quitter", exits_in_detect)
    assert_broken_and_skipped(registry, record, "detection raised SystemExit: vendor runtime not found, exiting")


def test_a_plugin_whose_detection_returns_something_else_than_a_device_report_is_recorded():
    registry, record = discover_with("nonsense", nonsense_detect)
    assert_broken_and_skipped(registry, record, "devshim_detect returned dict ({'available': True, ")
    assert record.error.endswith("; it must return a devshim_core.DeviceReport")


def test_a_plugin_that_does_not_implement_detection_at_all_is_recorded():
    class NoDetect:
        @hookimpl
        def devshim_allocator(self, report):
            raise AssertionError("never called")

    registry, record = discover_with("silent", NoDetect())
    assert_broken_and_skipped(registry, record, "devshim_detect returned NoneType (None)")


def test_a_plugin_whose_report_breaks_the_report_rules_is_recorded_even_with_a_winning_priority():
    registry, record = discover_with("invalid", invalid_report)
    assert_broken_and_skipped(registry, record,
                              "devshim_detect returned an invalid report: an available device must report "
                              "device_count >= 1")
    assert record.report is None  # its priority of 500 cannot win


@pytest.mark.parametrize(("report", "complaint"), [
    (DeviceReport(available="yes", reason="r", device_type="npu", device_count=1), "available must be a bool"),
    (DeviceReport(available=False, reason="", device_type="npu"), "reason must be a non-empty str"),
    (DeviceReport(available=False, reason="r", device_type="not a type!"), "device_type must be a torch device"),
    (DeviceReport(available=False, reason="r", device_type="npu", device_count=-1), "device_count must be an int"),
    (DeviceReport(available=False, reason="r", device_type="npu", priority=1.5), "priority must be an int"),
])
def test_each_rule_of_a_device_report_is_checked(report, complaint):
    class Plugin:
        @hookimpl
        def devshim_detect(self):
            return report

    registry, record = discover_with("odd", Plugin())
    assert_broken_and_skipped(registry, record, f"devshim_detect returned an invalid report: {complaint}")


# -- registration ------------------------------------------------------------------------------


def test_a_plugin_implementing_a_hook_devshim_does_not_define_is_recorded_as_a_likely_typo_and_unregistered():
    registry, record = discover_with("typo", typo_hook)
    assert_broken_and_skipped(registry, record,
                              "implements hooks that devshim does not define: devshim_allocater (a typo, or a "
                              "plugin built for another devshim version)")
    assert record.plugin is None and record.report is None
    assert typo_hook not in registry.manager.get_plugins()


def test_a_hook_implementation_whose_arguments_do_not_match_the_spec_is_recorded_as_invalid():
    class WrongArguments:
        @hookimpl
        def devshim_detect(self, device_index):
            raise AssertionError("never called")

    registry, record = discover_with("wrongargs", WrongArguments())
    assert_broken_and_skipped(registry, record, "invalid plugin: PluginValidationError: ")
    assert "device_index" in record.error


def test_a_plugin_that_fails_to_import_is_recorded_with_its_distribution_and_the_import_error(tmp_path, monkeypatch):
    distribution, entry_point = BROKEN_DISTRIBUTIONS["raises_at_import"]
    write_distribution(tmp_path, distribution, "0.0.1", {"raises_at_import": entry_point})
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = discover(Settings(), extra=[("healthy", FakePlugin(priority=1))])
    record = registry.records["raises_at_import"]
    assert (record.distribution, record.version, record.entry_point) == (distribution, "0.0.1", entry_point)
    assert_broken_and_skipped(registry, record, "failed to import: ImportError: libvendor_runtime.so.3: cannot open "
                                                "shared object file")
    assert "raises_at_import.py" in record.error_detail


def test_a_plugin_that_exits_while_importing_is_recorded_too(tmp_path, monkeypatch):
    (tmp_path / "devshim_exit_on_import.py").write_text("import sys\nsys.exit(1)\n")
    write_distribution(tmp_path, "devshim-exit-on-import", "1.0", {"exit_on_import": "devshim_exit_on_import"})
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = discover(Settings(), extra=[("healthy", FakePlugin(priority=1))])
    assert_broken_and_skipped(registry, registry.records["exit_on_import"], "failed to import: SystemExit: 1")


TWIN_CONFLICT = ("conflict: plugin name 'twin' is registered by devshim-twin-a 1.0 and devshim-twin-b 2.0; devshim "
                 "loads neither. Uninstall one, or pick one with DEVSHIM_PLUGIN=twin@<distribution>")


def test_two_distributions_registering_the_same_name_are_both_refused_naming_both(tmp_path, monkeypatch):
    """Which one would load could only depend on sys.path or name order, which nobody chose: neither is loaded."""
    install_broken_plugins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = discover(Settings(), extra=[("healthy", FakePlugin(priority=0))])
    first, second = registry.records["twin"], registry.records["twin@devshim-twin-b"]
    assert (first.distribution, second.distribution) == ("devshim-twin-a", "devshim-twin-b")
    for record in (first, second):
        assert record.plugin is None and record.report is None and not record.available
        assert record.reason == TWIN_CONFLICT
    selection = select(registry, Settings())
    assert selection.plugin.name == "healthy"  # though either twin (priority 1) would have outranked it...
    assert [r.distribution for r in selection.passed_over if r.name == "twin"] == ["devshim-twin-a", "devshim-twin-b"]
    assert "twin (" + TWIN_CONFLICT + ")" in selection.fallback_warning()  # ... which the user is told


def test_forcing_a_name_two_distributions_register_is_an_error_until_one_is_picked_by_distribution(
        tmp_path, monkeypatch):
    install_broken_plugins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    forced = Settings.from_env({"DEVSHIM_PLUGIN": "twin"})
    with pytest.raises(SelectionError) as excinfo:
        select(discover(forced), forced)
    assert str(excinfo.value).startswith(f"DEVSHIM_PLUGIN=twin is forced but that plugin cannot be used: "
                                         f"{TWIN_CONFLICT}")
    picked = Settings.from_env({"DEVSHIM_PLUGIN": "twin@devshim-twin-b"})
    registry = discover(picked)
    assert registry.records["twin"].distribution == "devshim-twin-b"
    assert registry.records["twin"].reason == "twin from devshim-twin-b"
    assert registry.records["twin@devshim-twin-a"].reason.startswith("conflict: plugin name 'twin' is registered by "
                                                                     "devshim-twin-a 1.0 and devshim-twin-b 2.0; "
                                                                     "devshim loads only devshim-twin-b.")
    assert select(registry, picked).plugin.distribution == "devshim-twin-b"
    unknown = Settings.from_env({"DEVSHIM_PLUGIN": "twin@devshim-twin-c"})
    with pytest.raises(SelectionError, match="no installed distribution named 'devshim-twin-c' registers the plugin "
                                             "'twin'"):
        discover(unknown)


def test_a_distribution_registering_an_installed_plugins_name_cannot_replace_it_even_when_that_name_is_forced(
        tmp_path, monkeypatch):
    write_distribution(tmp_path, "zz-impostor", "9.9", {"cpu_reference": "plugin_fixtures.twin:from_a"})
    monkeypatch.syspath_prepend(str(tmp_path))
    forced = Settings.from_env({"DEVSHIM_PLUGIN": "cpu_reference"})
    with pytest.raises(SelectionError) as excinfo:
        select(discover(forced), forced)
    assert ("plugin name 'cpu_reference' is registered by devshim-cpu-reference 0.1.0 and zz-impostor 9.9; devshim "
            "loads neither") in str(excinfo.value)
    picked = Settings.from_env({"DEVSHIM_PLUGIN": "cpu_reference@devshim-cpu-reference"})
    selection = select(discover(picked), picked)
    assert (selection.plugin.distribution, selection.plugin.report.device_type) == ("devshim-cpu-reference", "cpu")


def test_all_failures_at_once_still_leave_a_working_selection(tmp_path, monkeypatch):
    install_broken_plugins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = discover(Settings())
    broken = {r.name for r in registry if r.error}
    assert broken == set(BROKEN_DISTRIBUTIONS)
    assert select(registry, Settings()).plugin.name == "cpu_reference"


# -- after selection: the later hooks ----------------------------------------------------------


def test_a_selected_plugin_raising_in_a_later_hook_is_a_plugin_error_naming_the_plugin_and_the_hook():
    registry = discover(only("stale"), extra=[("stale", RaisesInAllocator(priority=1))])
    selection = select(registry, only("stale"))
    with pytest.raises(PluginError) as excinfo:
        build_device(registry, selection)
    message = str(excinfo.value)
    assert message.startswith("plugin 'stale' raised in devshim_allocator: RuntimeError: allocator handle is stale")
    assert "DEVSHIM_PLUGIN=<name>" in message and "DEVSHIM_DISABLED_PLUGINS=stale" in message
    assert isinstance(excinfo.value.__cause__, RuntimeError)


def test_a_selected_plugin_without_a_required_hook_is_a_plugin_error():
    registry = discover(only("bare"), extra=[("bare", DetectOnly())])
    with pytest.raises(PluginError, match=r"^plugin 'bare' does not implement devshim_device_module, which a "
                                          r"selectable plugin must\.$"):
        build_device(registry, select(registry, only("bare")))


def test_a_selected_plugin_answering_a_later_hook_with_the_wrong_type_is_a_plugin_error():
    registry = discover(only("wrong"), extra=[("wrong", WrongTraits(priority=1))])
    with pytest.raises(PluginError, match=r"^plugin 'wrong': devshim_device_traits returned dict, expected "
                                          r"DeviceTraits\.$"):
        build_device(registry, select(registry, only("wrong")))


def test_later_hooks_are_asked_of_the_selected_plugin_only():
    """A broken plugin that was not selected is never called again after detection."""
    registry = discover(only("good", "stale"), extra=[("good", FakePlugin(priority=2)),
                                                      ("stale", RaisesInAllocator(priority=1))])
    device = build_device(registry, select(registry, only("good", "stale")))
    assert device.plugin == "good"
    assert device.memory_allocated() > 0


def test_discovery_tolerates_plugins_but_does_not_swallow_keyboard_interrupt():
    class Interrupted:
        @hookimpl
        def devshim_detect(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        discover(only("ctrl_c"), extra=[("ctrl_c", Interrupted())])


def test_the_registry_uses_a_real_pluggy_manager_for_the_devshim_project():
    registry = discover(only("healthy"), extra=[("healthy", FakePlugin())])
    assert isinstance(registry.manager, pluggy.PluginManager)
    assert registry.manager.project_name == "devshim"


# -- the same, end to end ----------------------------------------------------------------------

_ACTIVATE_AND_REPORT = """
import json
import devshim_core.auto as auto
print(json.dumps({"selected": auto.session.selection.plugin.name,
                  "plugins": {key: r.as_dict() for key, r in auto.session.registry.records.items()}}))
"""


def test_import_devshim_core_auto_still_works_with_every_kind_of_broken_plugin_installed(tmp_path):
    site = install_broken_plugins(tmp_path / "site")
    result = run([PYTHON, "-c", _ACTIVATE_AND_REPORT], clean_env(pythonpath=[site, TESTS_DIR]))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["selected"] == "cpu_reference"
    plugins = report["plugins"]
    expected_errors = {
        "raises_at_import": "failed to import: ImportError: libvendor_runtime.so.3",
        "raises_in_detect": "detection raised OSError: driver /dev/vendor0 is not loaded",
        "exits_in_detect": "detection raised SystemExit: vendor runtime not found, exiting",
        "nonsense_detect": "devshim_detect returned dict",
        "invalid_report": "devshim_detect returned an invalid report",
        "typo_hook": "implements hooks that devshim does not define: devshim_allocater",
    }
    for name, error in expected_errors.items():
        assert plugins[name]["error"].startswith(error), plugins[name]
        assert plugins[name]["available"] is False
        assert plugins[name]["distribution"] == BROKEN_DISTRIBUTIONS[name][0]
    assert plugins["twin"]["reason"] == plugins["twin@devshim-twin-b"]["reason"] == TWIN_CONFLICT
    assert plugins["cpu_reference"]["available"] is True
