"""Spec: ``devshim_core.activate()`` and ``devshim_core.active_session()``, the public Python API.

Each spec runs a fresh interpreter (an activation is once per process), outside the source tree, with the
suite's environment minus every devshim switch.
"""

from __future__ import annotations

import json
import textwrap

from plugin_fixtures import DEVSHIM_SCRIPT, PYTHON, clean_env, run, run_json

ENV = clean_env(DEVSHIM_PLUGIN="cpu_reference", DEVSHIM_CPU_DEVICE_COUNT="2")


def python_json(code: str, **env: str) -> dict:
    """What ``code`` printed as JSON on its last line."""
    result = run([PYTHON, "-c", textwrap.dedent(code)], {**ENV, **env})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_package_activates_nothing_and_active_session_does_not_either():
    seen = python_json("""
        import json, sys, devshim_core
        before = devshim_core.active_session()
        print(json.dumps({"before": before, "again": devshim_core.active_session(),
                          "torch_imported": "torch" in sys.modules}))
    """)
    assert seen == {"before": None, "again": None, "torch_imported": False}


def test_activate_names_the_selected_plugin_device_and_reason():
    seen = python_json("""
        import json, devshim_core
        info = devshim_core.activate()
        print(json.dumps({"plugin": info.plugin, "device_type": info.device_type, "reason": info.reason,
                          "count": info.device["device_count"], "backend": info.device["backend"],
                          "same": devshim_core.activate() == info == devshim_core.active_session()}))
    """)
    assert seen == {"plugin": "cpu_reference", "device_type": "cpu", "reason": "forced by DEVSHIM_PLUGIN=cpu_reference",
                    "count": 2, "backend": "gloo", "same": True}


def test_the_auto_import_and_activate_are_the_same_session():
    seen = python_json("""
        import json, devshim_core, devshim_core.auto
        print(json.dumps({"plugin": devshim_core.active_session().plugin,
                          "same": devshim_core.activate() == devshim_core.active_session()}))
    """)
    assert seen == {"plugin": "cpu_reference", "same": True}


def test_an_armed_integration_shows_applied_once_the_script_imported_its_framework():
    seen = python_json("""
        import json, devshim_core
        before = devshim_core.activate().integrations["deepspeed"]
        import deepspeed
        after = devshim_core.active_session()
        print(json.dumps({"before": before, "after": after.integrations["deepspeed"],
                          "sets": sorted({row["set"] for row in after.patches})}))
    """)
    assert seen["before"].startswith("armed: applied when deepspeed is imported"), seen
    assert seen["after"].startswith("applied when deepspeed is imported"), seen
    assert any(name.startswith("deepspeed") for name in seen["sets"]), seen


def test_the_snapshot_is_read_only():
    seen = python_json("""
        import dataclasses, json, operator, devshim_core
        info = devshim_core.activate()
        refused = []
        for attempt in (lambda: setattr(info, "plugin", "x"), lambda: operator.setitem(info.integrations, "x", "y"),
                        lambda: operator.setitem(info.device, "backend", "nccl")):
            try:
                attempt()
            except (dataclasses.FrozenInstanceError, TypeError) as exc:
                refused.append(type(exc).__name__)
        print(json.dumps(refused))
    """)
    assert seen == ["FrozenInstanceError", "TypeError", "TypeError"]


def test_it_reports_what_devshim_info_json_reports():
    """The same facts under the same keys: ``devshim info`` imports DeepSpeed to fire its armed patches, so
    the script does too before asking."""
    api = python_json("""
        import json, devshim_core
        devshim_core.activate()
        import deepspeed
        print(json.dumps(devshim_core.active_session().as_dict(), default=str))
    """)
    cli = run_json([DEVSHIM_SCRIPT, "info", "--json"], ENV)
    assert set(api) == {"selected", "reason", "device", "plugins", "integrations", "patches", "disabled"}
    for key in api:
        assert api[key] == cli[key], f"{key}: api {api[key]!r} != cli {cli[key]!r}"
    assert len(api["patches"]) > 10  # a real activation, not an empty report


def test_an_emulated_device_is_labelled_as_not_hardware():
    seen = python_json("""
        import json, devshim_core
        info = devshim_core.activate()
        print(json.dumps({"plugin": info.plugin, "emulation": info.emulation,
                          "in_dict": info.as_dict()["emulation"] == info.emulation}))
    """, DEVSHIM_PLUGIN="ascend", DEVSHIM_EMULATE="ascend", DEVSHIM_EMULATE_DEVICES="2")
    assert seen["plugin"] == "ascend" and seen["in_dict"], seen
    assert seen["emulation"].startswith("EMULATED DEVICE -- NOT HARDWARE: DEVSHIM_EMULATE=ascend"), seen
