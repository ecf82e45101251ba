"""Spec: selection turns the plugins' availability reports into one choice and a reason for it.

Plugins are registered in-process with ``discover(settings, extra=[(name, plugin)])``; the project's own
plugins (ascend, cpu_reference, sophgo) are installed too, and on this machine only cpu_reference is available.
"""

from __future__ import annotations

import pytest
from plugin_fixtures import INSTALLED_PLUGINS, FakePlugin, only

from devshim_core.device import build_device
from devshim_core.errors import SelectionError
from devshim_core.plugins import discover
from devshim_core.selection import describe_plugins, select
from devshim_core.settings import Settings


def choose(settings: Settings, **plugins: FakePlugin):
    registry = discover(settings, extra=list(plugins.items()))
    return registry, select(registry, settings)


# -- what is found -----------------------------------------------------------------------------


def test_every_installed_plugin_is_discovered_with_its_distribution_and_version():
    registry = discover(Settings())
    for name in INSTALLED_PLUGINS:
        record = registry.records[name]
        assert record.distribution == f"devshim-{name.replace('_', '-')}"
        assert record.version == "0.1.0"
        assert record.error is None and record.report is not None


def test_on_a_machine_without_accelerators_the_cpu_reference_plugin_is_the_only_choice():
    registry = discover(Settings())
    selection = select(registry, Settings())
    assert selection.plugin.name == "cpu_reference"
    assert selection.reason == "the only available plugin"
    assert not registry.records["ascend"].available and not registry.records["sophgo"].available


# -- priority ----------------------------------------------------------------------------------


def test_the_available_plugin_with_the_highest_priority_is_selected_over_the_cpu_fallback():
    _, selection = choose(Settings(), vendor=FakePlugin(priority=10))
    assert selection.plugin.name == "vendor"
    assert selection.reason == "highest priority (10) of the available plugins; also available: cpu_reference"


def test_priority_orders_the_candidates_whatever_their_names_or_registration_order():
    _, selection = choose(only("a", "b", "c"), a=FakePlugin(priority=1), b=FakePlugin(priority=30),
                          c=FakePlugin(priority=20))
    assert selection.plugin.name == "b"
    assert selection.reason == "highest priority (30) of the available plugins; also available: c, a"


def test_priorities_may_be_negative():
    _, selection = choose(only("low", "lower"), low=FakePlugin(priority=-5), lower=FakePlugin(priority=-50))
    assert selection.plugin.name == "low"


def test_an_unavailable_plugin_is_never_selected_however_high_its_priority():
    registry, selection = choose(Settings(), absent=FakePlugin(priority=1000, available=False))
    assert selection.plugin.name == "cpu_reference"
    assert registry.records["absent"].reason == "not available: fake device absent"


def test_two_plugins_with_equal_priority_are_decided_by_name_and_the_tie_is_reported():
    for order in (("beta", "alpha"), ("alpha", "beta")):  # registration order must not matter
        plugins = {name: FakePlugin(priority=50) for name in order}
        _, selection = choose(Settings(), **plugins)
        assert selection.plugin.name == "alpha"
        assert selection.reason == ("highest priority (50) of the available plugins; tied at priority 50 with beta, "
                                    "chosen by name order (force one with DEVSHIM_PLUGIN=<name>); "
                                    "also available: cpu_reference")


def test_a_selection_builds_a_device_that_remembers_why_it_was_chosen():
    registry, selection = choose(only("vendor"), vendor=FakePlugin(priority=3, device_count=4))
    device = build_device(registry, selection)
    assert device.plugin == "vendor"
    assert device.info.selection_reason == "the only available plugin"
    assert device.device_count() == 4


# -- DEVSHIM_PLUGIN: forced --------------------------------------------------------------------


def test_a_forced_plugin_is_selected_even_with_a_lower_priority():
    settings = Settings.from_env({"DEVSHIM_PLUGIN": "cpu_reference"})
    _, selection = choose(settings, vendor=FakePlugin(priority=100))
    assert selection.plugin.name == "cpu_reference"
    assert selection.reason == "forced by DEVSHIM_PLUGIN=cpu_reference"


def test_a_forced_plugin_is_loaded_even_when_autoload_is_off_and_it_is_not_allowlisted():
    settings = only("a", DEVSHIM_PLUGIN="b")
    _, selection = choose(settings, a=FakePlugin(priority=9), b=FakePlugin(priority=1))
    assert selection.plugin.name == "b"


def test_forcing_an_unknown_name_lists_every_installed_plugin_and_why_each_is_or_is_not_available():
    settings = Settings.from_env({"DEVSHIM_PLUGIN": "nvidia"})
    registry = discover(settings, extra=[("vendor", FakePlugin(priority=7))])
    with pytest.raises(SelectionError) as excinfo:
        select(registry, settings)
    message = str(excinfo.value)
    assert message.startswith("DEVSHIM_PLUGIN names 'nvidia', which is not an installed devshim plugin. "
                              "Installed plugins:\n")
    assert "  - ascend (devshim-ascend 0.1.0): not available: torch_npu is not installed" in message
    assert "  - cpu_reference (devshim-cpu-reference 0.1.0): the host CPU is always available" in message
    assert "  - sophgo (devshim-sophgo 0.1.0): not available: Sophgo's torch_tpu is not installed" in message
    assert "  - vendor (<in-process>): fake device present" in message


def test_forcing_an_unavailable_plugin_says_why_it_cannot_be_used_and_lists_the_others():
    settings = Settings.from_env({"DEVSHIM_PLUGIN": "ascend"})
    registry = discover(settings)
    with pytest.raises(SelectionError) as excinfo:
        select(registry, settings)
    message = str(excinfo.value)
    assert message.startswith("DEVSHIM_PLUGIN=ascend is forced but that plugin cannot be used: "
                              "not available: torch_npu is not installed")
    assert "Installed plugins:\n" in message
    for name in INSTALLED_PLUGINS:
        assert f"  - {name} (devshim-" in message


def test_forcing_a_plugin_that_failed_detection_says_it_is_broken():
    from plugin_fixtures import raises_in_detect

    settings = Settings.from_env({"DEVSHIM_PLUGIN": "flaky"})
    registry = discover(settings, extra=[("flaky", raises_in_detect)])
    with pytest.raises(SelectionError, match=r"DEVSHIM_PLUGIN=flaky is forced but that plugin cannot be used: "
                                             r"broken: detection raised OSError: driver /dev/vendor0 is not loaded"):
        select(registry, settings)


# -- DEVSHIM_DISABLED_PLUGINS: blocked ---------------------------------------------------------


def test_a_blocked_plugin_is_never_loaded_nor_asked_and_the_next_best_is_selected():
    best, second = FakePlugin(priority=90), FakePlugin(priority=80)
    settings = Settings.from_env({"DEVSHIM_DISABLED_PLUGINS": "best"})
    registry, selection = choose(settings, best=best, second=second)
    assert selection.plugin.name == "second"
    record = registry.records["best"]
    assert record.plugin is None and best.detect_calls == 0
    assert not record.available and record.reason == "blocked by DEVSHIM_DISABLED_PLUGINS"
    assert record.as_dict()["available"] is False


def test_blocking_every_available_plugin_leaves_nothing_to_select_and_says_why():
    settings = Settings.from_env({"DEVSHIM_DISABLED_PLUGINS": "cpu_reference"})
    registry = discover(settings)
    with pytest.raises(SelectionError) as excinfo:
        select(registry, settings)
    message = str(excinfo.value)
    assert message.startswith("no devshim plugin is available on this machine. Installed plugins:\n")
    assert "  - cpu_reference (devshim-cpu-reference 0.1.0): blocked by DEVSHIM_DISABLED_PLUGINS" in message


def test_a_blocked_plugin_does_not_count_for_a_tie():
    settings = Settings.from_env({"DEVSHIM_DISABLED_PLUGINS": "alpha"})
    _, selection = choose(settings, alpha=FakePlugin(priority=50), beta=FakePlugin(priority=50))
    assert selection.plugin.name == "beta"
    assert "tied" not in selection.reason


# -- DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 + DEVSHIM_PLUGINS: allowlisted --------------------------


def test_without_autoload_only_the_allowlisted_plugins_are_loaded_and_considered():
    a, b, c = FakePlugin(priority=1), FakePlugin(priority=2), FakePlugin(priority=99)
    registry, selection = choose(only("a", "b"), a=a, b=b, c=c)
    assert selection.plugin.name == "b"
    assert selection.reason == "highest priority (2) of the available plugins; also available: a"
    assert c.detect_calls == 0
    for name in ("c", *INSTALLED_PLUGINS):
        record = registry.records[name]
        assert record.plugin is None
        assert record.reason == "not loaded: DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 and it is not in DEVSHIM_PLUGINS"


def test_an_allowlisted_name_that_is_not_installed_is_an_error_listing_what_is():
    settings = only("cpu_reference", "ascned")
    registry = discover(settings)
    with pytest.raises(SelectionError) as excinfo:
        select(registry, settings)
    message = str(excinfo.value)
    assert message.startswith("DEVSHIM_PLUGINS names 'ascned', which is not an installed devshim plugin.")
    assert "  - ascend (devshim-ascend 0.1.0): not loaded" in message


def test_describe_plugins_gives_one_line_per_installed_plugin():
    registry = discover(only("cpu_reference"))
    lines = describe_plugins(registry).splitlines()
    assert [line.split(" ")[3] for line in lines] == sorted(INSTALLED_PLUGINS)
