"""Spec: a CUDA job script's environment reaches the selected plugin's device in the plugin's own variables.

Fault injected: a job script sets ``CUDA_VISIBLE_DEVICES``, ``PYTORCH_CUDA_ALLOC_CONF``, ``NCCL_*`` and
``TORCH_NCCL_*``, which a vendor runtime never reads. What the user sees: devshim sets the vendor variable the plugin
maps each one to (``devshim_environment_map``), before the device facade is built, never over a vendor variable the
user set; ``devshim info`` lists every translation; one warning names what has no effect on the device; devshim
unsets what it set when it deactivates. A plugin that declares no mapping (``cuda``) changes nothing.

In-process specs activate devshim on a fake plugin (``session.activate(..., extra_plugins=...)``) with the
environment under ``monkeypatch``; the ``cpu_reference`` specs run ``devshim info`` and a script in fresh interpreters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from plugin_fixtures import DEVSHIM_SCRIPT, PYTHON, FakePlugin, clean_env, run, run_json

from devshim_core import hookimpl, session
from devshim_core.env_migration import allocator_config, is_source, visible_devices
from devshim_core.errors import ConfigError, PluginError
from devshim_core.records import DeviceReport, EnvironmentMap

PLUGIN = "env_under_test"
VENDOR_VISIBLE = "ACME_VISIBLE_DEVICES"
VENDOR_ALLOC = "ACME_ALLOC_CONF"


def _environment(**settings: str) -> dict[str, str]:
    """A fresh process's environment: no devshim, vendor or CUDA/NCCL variable but ``settings``."""
    env = {k: v for k, v in clean_env().items() if not is_source(k) and not k.startswith("ACME_")}
    return {**env, **settings}


class MapsToAcme(FakePlugin):
    """A fake device whose runtime reads ``ACME_*`` variables, with its own allocator keys."""

    @hookimpl
    def devshim_environment_map(self, report: DeviceReport) -> EnvironmentMap:
        return EnvironmentMap(
            variables={"CUDA_VISIBLE_DEVICES": VENDOR_VISIBLE, "PYTORCH_CUDA_ALLOC_CONF": VENDOR_ALLOC,
                       "NCCL_SOCKET_IFNAME": "ACME_SOCKET_IFNAME"},
            convert={"CUDA_VISIBLE_DEVICES": visible_devices,
                     "PYTORCH_CUDA_ALLOC_CONF": allocator_config(("max_split_size_mb", "expandable_segments"))},
            ignored=("TORCH_NCCL_",))


class MapsNothing(FakePlugin):
    """Declares no mapping, as the ``cuda`` plugin: CUDA reads its own variables."""


class MapsAnUnknownVariable(FakePlugin):
    @hookimpl
    def devshim_environment_map(self, report: DeviceReport) -> EnvironmentMap:
        return EnvironmentMap(variables={"OMP_NUM_THREADS": "ACME_THREADS"})


@pytest.fixture
def activate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``activate(plugin, **environment)``: devshim activated on ``plugin`` with only ``environment`` among the
    CUDA/NCCL and ``ACME_*`` variables; the suite's own session is back afterwards."""
    for name in list(os.environ):
        if is_source(name) or name.startswith("ACME_"):
            monkeypatch.delenv(name)
    had_session = session.current() is not None
    session.deactivate()

    def activated(plugin: object, **environment: str) -> session.Session:
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        return session.activate({"DEVSHIM_PLUGIN": PLUGIN}, extra_plugins=[(PLUGIN, plugin)])

    try:
        yield activated
    finally:
        session.deactivate()
        if had_session:
            session.activate()


@contextlib.contextmanager
def devshim_log() -> Iterator[list[logging.LogRecord]]:
    """The records devshim's ``env`` logger emits meanwhile."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("devshim.env")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# -- translation -----------------------------------------------------------------------------------------------------


def test_each_mapped_setting_is_set_in_the_vendors_variable_before_the_device_is_built_and_logged(activate):
    with devshim_log() as records:
        active = activate(MapsToAcme(), CUDA_VISIBLE_DEVICES="1, 3", NCCL_SOCKET_IFNAME="^docker,lo",
                          PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128,backend:cudaMallocAsync")
    assert os.environ[VENDOR_VISIBLE] == "1,3"
    assert os.environ["ACME_SOCKET_IFNAME"] == "^docker,lo"
    assert os.environ[VENDOR_ALLOC] == "max_split_size_mb:128"
    outcomes = {t.source: (t.outcome, t.target, t.target_value) for t in active.environment.translations}
    assert outcomes == {"CUDA_VISIBLE_DEVICES": ("applied", VENDOR_VISIBLE, "1,3"),
                        "NCCL_SOCKET_IFNAME": ("applied", "ACME_SOCKET_IFNAME", "^docker,lo"),
                        "PYTORCH_CUDA_ALLOC_CONF": ("applied", VENDOR_ALLOC, "max_split_size_mb:128")}
    alloc = next(t for t in active.environment.translations if t.source == "PYTORCH_CUDA_ALLOC_CONF")
    assert "dropped backend" in alloc.note
    logged = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(logged) == 3 and any("CUDA_VISIBLE_DEVICES='1, 3' -> ACME_VISIBLE_DEVICES='1,3'" in m for m in logged)
    assert active.warnings == []


def test_a_vendor_variable_the_user_set_wins_and_the_warning_says_the_cuda_one_was_not_applied(activate):
    with devshim_log() as records:
        active = activate(MapsToAcme(), CUDA_VISIBLE_DEVICES="1", ACME_VISIBLE_DEVICES="0")
    assert os.environ[VENDOR_VISIBLE] == "0"
    [warning] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert "CUDA_VISIBLE_DEVICES='1' not applied: ACME_VISIBLE_DEVICES='0' is set already" in warning
    assert active.warnings == [warning]
    session.deactivate()
    assert os.environ[VENDOR_VISIBLE] == "0", "devshim unset a variable the user set"


def test_a_vendor_variable_already_holding_the_translation_is_left_alone_without_a_warning(activate):
    # a launcher (or a parent process devshim ran in) set it: nothing is lost
    active = activate(MapsToAcme(), CUDA_VISIBLE_DEVICES="0,1", ACME_VISIBLE_DEVICES="0,1")
    [translation] = active.environment.translations
    assert translation.outcome == "already set"
    assert active.warnings == [] and active.environment.set_by_devshim == {}


def test_untranslatable_settings_are_named_in_one_warning_and_ignored_ones_only_in_the_report(activate):
    with devshim_log() as records:
        active = activate(MapsToAcme(), CUDA_VISIBLE_DEVICES="GPU-8f6c2a1e", NCCL_IB_HCA="mlx5_0",
                          NCCL_DEBUG="INFO", PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync",
                          TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for named in ("CUDA_VISIBLE_DEVICES='GPU-8f6c2a1e' untranslatable: only device indices",
                  "NCCL_IB_HCA='mlx5_0' untranslatable", "NCCL_DEBUG='INFO' untranslatable",
                  "PYTORCH_CUDA_ALLOC_CONF='backend:cudaMallocAsync' untranslatable: dropped backend"):
        assert named in warnings[0]
    assert "TORCH_NCCL" not in warnings[0]
    ignored = [t for t in active.environment.translations if t.outcome == "ignored"]
    assert [t.source for t in ignored] == ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert VENDOR_VISIBLE not in os.environ and VENDOR_ALLOC not in os.environ


def test_deactivation_unsets_what_devshim_set_and_a_new_activation_sets_it_again(activate):
    activate(MapsToAcme(), CUDA_VISIBLE_DEVICES="2")
    assert os.environ[VENDOR_VISIBLE] == "2"
    session.deactivate()
    assert VENDOR_VISIBLE not in os.environ
    session.activate({"DEVSHIM_PLUGIN": PLUGIN}, extra_plugins=[(PLUGIN, MapsToAcme())])
    assert os.environ[VENDOR_VISIBLE] == "2"


def test_the_device_is_detected_again_after_a_translation_so_its_report_counts_what_the_runtime_sees(activate):
    translated, untouched = MapsToAcme(), MapsToAcme()
    activate(translated, CUDA_VISIBLE_DEVICES="0")
    session.deactivate()
    del os.environ["CUDA_VISIBLE_DEVICES"]
    session.activate({"DEVSHIM_PLUGIN": PLUGIN}, extra_plugins=[(PLUGIN, untouched)])
    assert (translated.detect_calls, untouched.detect_calls) == (2, 1)


def test_a_plugin_without_a_mapping_changes_nothing_and_warns_about_nothing(activate):
    with devshim_log() as records:
        active = activate(MapsNothing(), CUDA_VISIBLE_DEVICES="1", NCCL_IB_HCA="mlx5_0")
    assert active.environment is None and records == []
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_map_of_a_variable_that_is_no_cuda_or_nccl_setting_stops_activation_naming_plugin_and_hook(activate):
    with pytest.raises(PluginError, match=f"plugin '{PLUGIN}': devshim_environment_map returned EnvironmentMap "
                                          "whose variables maps 'OMP_NUM_THREADS'"):
        activate(MapsAnUnknownVariable())


def test_a_converter_that_answers_nonsense_stops_activation_naming_the_plugin_and_sets_nothing(activate):
    class ConvertsToAnInt(MapsToAcme):
        @hookimpl
        def devshim_environment_map(self, report: DeviceReport) -> EnvironmentMap:
            return EnvironmentMap(variables={"CUDA_VISIBLE_DEVICES": VENDOR_VISIBLE},
                                  convert={"CUDA_VISIBLE_DEVICES": lambda value: (int(value), "")})

    with pytest.raises(PluginError, match=f"plugin '{PLUGIN}': a converter of its devshim_environment_map raised "
                                          "TypeError: converting CUDA_VISIBLE_DEVICES gave"):
        activate(ConvertsToAnInt(), CUDA_VISIBLE_DEVICES="1")
    assert VENDOR_VISIBLE not in os.environ


def test_a_translation_that_leaves_no_usable_device_is_undone_and_named(activate):
    class LosesItsDevice(MapsToAcme):
        @hookimpl
        def devshim_detect(self) -> DeviceReport:
            if os.environ.get(VENDOR_VISIBLE) == "7":
                return DeviceReport(available=False, reason="no device 7 on this node", device_type="cpu")
            return self.report

    with pytest.raises(ConfigError) as raised:
        activate(LosesItsDevice(), CUDA_VISIBLE_DEVICES="7")
    assert ("CUDA_VISIBLE_DEVICES='7' -> ACME_VISIBLE_DEVICES='7'" in str(raised.value)
            and "no device 7 on this node" in str(raised.value))
    assert VENDOR_VISIBLE not in os.environ


# -- the cpu_reference plugin, as a job runs it ---------------------------------------------------------------------


def test_cpu_reference_narrows_its_device_slots_by_cuda_visible_devices_and_devshim_info_reports_it():
    env = _environment(DEVSHIM_PLUGIN="cpu_reference", CUDA_VISIBLE_DEVICES="1,3", NCCL_IB_HCA="mlx5_0")
    report = run_json([DEVSHIM_SCRIPT, "info", "--json"], env)
    assert report["device"]["device_count"] == 2
    translations = {t["source"]: t for t in report["environment"]["translations"]}
    assert translations["CUDA_VISIBLE_DEVICES"]["outcome"] == "applied"
    assert translations["CUDA_VISIBLE_DEVICES"]["target"] == "DEVSHIM_CPU_VISIBLE_DEVICES"
    assert translations["NCCL_IB_HCA"]["outcome"] == "ignored"  # gloo reads no NCCL setting
    text = run([DEVSHIM_SCRIPT, "info"], env)
    assert "CUDA_VISIBLE_DEVICES='1,3' -> DEVSHIM_CPU_VISIBLE_DEVICES='1,3'" in text.stdout


def test_a_script_sees_the_translated_count_and_the_variable_is_gone_after_deactivation():
    script = textwrap.dedent("""
        import json, os
        import devshim_core.auto
        from devshim_core import session
        seen = {"count": session.current().device.device_count(),
                "visible": os.environ.get("DEVSHIM_CPU_VISIBLE_DEVICES")}
        session.deactivate()
        seen["after"] = os.environ.get("DEVSHIM_CPU_VISIBLE_DEVICES")
        print(json.dumps(seen))
    """)
    result = run([PYTHON, "-c", script], _environment(DEVSHIM_PLUGIN="cpu_reference", CUDA_VISIBLE_DEVICES="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"count": 1, "visible": "2", "after": None}
    assert "CUDA_VISIBLE_DEVICES='2' -> DEVSHIM_CPU_VISIBLE_DEVICES='2'" in result.stderr


def test_the_cuda_plugin_declares_no_mapping_so_cuda_reads_the_job_script_variables_itself():
    import devshim_cuda
    import pluggy

    from devshim_core import hookspecs

    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(devshim_cuda)
    report = DeviceReport(available=True, reason="2 GPUs", device_type="cuda", device_count=2)
    assert manager.hook.devshim_environment_map(report=report) is None


def test_torchruns_own_async_error_handling_default_is_not_warned_about():
    """torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 in every worker: on a plugin that cannot translate it, that
    value is listed as ignored (torchrun's default), not warned about in every job; a value the user chose is."""
    from devshim_core.env_migration import IGNORED, UNTRANSLATABLE, plan

    mapping = EnvironmentMap(variables={"CUDA_VISIBLE_DEVICES": "TPU_VISIBLE_DEVICES"})
    default, = plan(mapping, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {})
    chosen, = plan(mapping, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {})
    assert (default.outcome, default.note) == (IGNORED, "torchrun's default in every worker")
    assert chosen.outcome == UNTRANSLATABLE
