"""Spec: devshim's environment switches are parsed once, and a value devshim cannot use is a ConfigError that
names the variable, the value and what to write instead."""

from __future__ import annotations

import pytest

from devshim_core.errors import ConfigError, DevshimError
from devshim_core.settings import Settings

BOOLEAN_SWITCHES = ("DEVSHIM_PATCH_DEEPSPEED", "DEVSHIM_PATCH_MEGATRON", "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD")


def test_an_empty_environment_autoloads_every_plugin_and_patches_every_framework():
    assert Settings.from_env({}) == Settings(forced=None, disabled=(), autoload=True, allowlist=(),
                                             patch_deepspeed=True, patch_megatron=True)


def test_from_env_without_a_mapping_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("DEVSHIM_PLUGIN", "cpu_reference")
    monkeypatch.setenv("DEVSHIM_PATCH_MEGATRON", "0")
    settings = Settings.from_env()
    assert settings.forced == "cpu_reference"
    assert settings.patch_megatron is False


def test_devshim_plugin_forces_one_name_with_surrounding_blanks_ignored():
    assert Settings.from_env({"DEVSHIM_PLUGIN": "  ascend "}).forced == "ascend"


@pytest.mark.parametrize("value", ["", "   ", ","])
def test_an_empty_devshim_plugin_forces_nothing(value):
    assert Settings.from_env({"DEVSHIM_PLUGIN": value}).forced is None


def test_devshim_plugin_naming_several_plugins_is_refused_and_points_at_the_allowlist():
    with pytest.raises(ConfigError) as excinfo:
        Settings.from_env({"DEVSHIM_PLUGIN": "ascend,sophgo"})
    message = str(excinfo.value)
    assert "DEVSHIM_PLUGIN='ascend,sophgo'" in message
    assert "exactly one" in message
    assert "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1" in message and "DEVSHIM_PLUGINS=a,b" in message


def test_plugin_lists_are_comma_separated_and_blank_entries_are_dropped():
    settings = Settings.from_env({"DEVSHIM_DISABLED_PLUGINS": " ascend, ,sophgo,",
                                  "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD": "1",
                                  "DEVSHIM_PLUGINS": "cpu_reference , acme-npu"})
    assert settings.disabled == ("ascend", "sophgo")
    assert settings.allowlist == ("cpu_reference", "acme-npu")
    assert settings.autoload is False


@pytest.mark.parametrize("variable", ["DEVSHIM_PLUGIN", "DEVSHIM_DISABLED_PLUGINS", "DEVSHIM_PLUGINS"])
def test_a_plugin_name_that_cannot_be_an_entry_point_name_is_a_config_error(variable):
    env = {"DEVSHIM_DISABLE_PLUGIN_AUTOLOAD": "1", "DEVSHIM_PLUGINS": "cpu_reference", variable: "ascend;rm -rf /"}
    with pytest.raises(ConfigError) as excinfo:
        Settings.from_env(env)
    message = str(excinfo.value)
    assert message.startswith(f"{variable}='ascend;rm -rf /'")
    assert "is not a plugin name" in message and "devshim plugins" in message


@pytest.mark.parametrize("variable", BOOLEAN_SWITCHES)
@pytest.mark.parametrize(("raw", "value"), [("1", True), ("true", True), ("YES", True), (" on ", True),
                                            ("0", False), ("False", False), ("no", False), ("OFF", False)])
def test_boolean_switches_accept_the_usual_spellings_in_any_case(variable, raw, value):
    env = {variable: raw, "DEVSHIM_PLUGINS": "cpu_reference"}  # DISABLE_PLUGIN_AUTOLOAD=1 needs an allowlist
    settings = Settings.from_env(env)
    parsed = {"DEVSHIM_PATCH_DEEPSPEED": settings.patch_deepspeed, "DEVSHIM_PATCH_MEGATRON": settings.patch_megatron,
              "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD": not settings.autoload}[variable]
    assert parsed is value


@pytest.mark.parametrize("variable", BOOLEAN_SWITCHES)
def test_a_blank_boolean_switch_keeps_its_default(variable):
    assert Settings.from_env({variable: "  "}) == Settings()


@pytest.mark.parametrize("variable", BOOLEAN_SWITCHES)
@pytest.mark.parametrize("raw", ["maybe", "2", "enabled", "y"])
def test_a_boolean_switch_with_any_other_value_is_a_config_error_saying_what_is_accepted(variable, raw):
    with pytest.raises(ConfigError) as excinfo:
        Settings.from_env({variable: raw})
    assert str(excinfo.value) == (f"{variable}={raw!r} is not a boolean: use 1 or 0 "
                                  "(also accepted: true/false, yes/no, on/off).")


def test_config_errors_are_devshim_errors():
    """Callers (the CLI, the start-up hook) catch DevshimError to print the message without a traceback."""
    with pytest.raises(DevshimError):
        Settings.from_env({"DEVSHIM_PATCH_DEEPSPEED": "maybe"})


def test_forcing_a_plugin_that_is_also_blocked_is_a_contradiction():
    with pytest.raises(ConfigError, match=r"DEVSHIM_PLUGIN=ascend forces a plugin that DEVSHIM_DISABLED_PLUGINS also "
                                          r"blocks; remove it from one of the two\."):
        Settings.from_env({"DEVSHIM_PLUGIN": "ascend", "DEVSHIM_DISABLED_PLUGINS": "sophgo,ascend"})


def test_disabling_autoload_without_an_allowlist_would_load_nothing_and_is_refused():
    with pytest.raises(ConfigError) as excinfo:
        Settings.from_env({"DEVSHIM_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert "DEVSHIM_PLUGINS" in str(excinfo.value) and "it is empty" in str(excinfo.value)


def test_disabling_autoload_with_a_forced_plugin_needs_no_allowlist():
    settings = Settings.from_env({"DEVSHIM_DISABLE_PLUGIN_AUTOLOAD": "1", "DEVSHIM_PLUGIN": "cpu_reference"})
    assert settings.autoload is False
    assert settings.wants_loaded("cpu_reference") is None
    assert settings.wants_loaded("ascend") is not None


class TestWhichPluginsAreLoaded:
    def test_with_autoload_every_plugin_is_loaded(self):
        settings = Settings.from_env({})
        assert [settings.wants_loaded(n) for n in ("ascend", "cpu_reference", "anything")] == [None, None, None]

    def test_a_blocked_plugin_is_not_loaded_and_the_reason_names_the_variable(self):
        settings = Settings.from_env({"DEVSHIM_DISABLED_PLUGINS": "ascend"})
        assert settings.wants_loaded("ascend") == "blocked by DEVSHIM_DISABLED_PLUGINS"
        assert settings.wants_loaded("sophgo") is None

    def test_without_autoload_only_allowlisted_and_forced_plugins_are_loaded(self):
        settings = Settings.from_env({"DEVSHIM_DISABLE_PLUGIN_AUTOLOAD": "1", "DEVSHIM_PLUGINS": "a,b",
                                      "DEVSHIM_PLUGIN": "c"})
        assert [settings.wants_loaded(n) for n in ("a", "b", "c")] == [None, None, None]
        assert settings.wants_loaded("cpu_reference") == ("not loaded: DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1 and it is "
                                                          "not in DEVSHIM_PLUGINS")

    def test_blocking_wins_over_the_allowlist(self):
        settings = Settings.from_env({"DEVSHIM_DISABLE_PLUGIN_AUTOLOAD": "1", "DEVSHIM_PLUGINS": "a,b",
                                      "DEVSHIM_DISABLED_PLUGINS": "b"})
        assert settings.wants_loaded("a") is None
        assert settings.wants_loaded("b") == "blocked by DEVSHIM_DISABLED_PLUGINS"
