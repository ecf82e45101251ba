"""Spec: integrations are a table of records. The session walks it in order; each integration reports through the
status it is handed; none imports the session; the table lists without applying anything; and a third party adds its
own integration through the ``devshim.integrations`` entry-point group, installed from a wheel."""

from __future__ import annotations

import ast
import json

import pytest
from plugin_fixtures import PROJECT_DIR, Background, checked_json, clean_env, layered_venv_with_wheel

from devshim_core.integrations import table
from devshim_core.integrations.base import Integration, Status
from devshim_core.patching import REGISTRY


def test_devshims_own_table_lists_in_install_order_without_applying_anything():
    before = REGISTRY.report()
    names = [i.name for i in table.builtin()]
    assert names == ["torch.distributed", "cuda-redirect", "deepspeed", "megatron", "checkpoints", "huggingface",
                     "compare"]
    assert REGISTRY.report() == before  # listing applied nothing
    megatron = table.builtin()[3].describe()
    assert megatron["needs"] == ["cuda-redirect"] and "megatron.core" in megatron["triggers"]
    assert megatron["framework"] == "megatron-core>=0.12.1,<0.17"
    assert "megatron-core" in megatron["patch_sets"]


def test_no_module_under_integrations_imports_the_session():
    offenders = []
    for path in (PROJECT_DIR / "devshim_core" / "integrations").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "devshim_core.session" or n.startswith("devshim_core.session.") for n in names) or (
                    isinstance(node, ast.ImportFrom) and node.module == "devshim_core"
                    and any(a.name == "session" for a in node.names)):
                offenders.append(str(path.relative_to(PROJECT_DIR)))
    assert offenders == []


def test_a_status_is_written_into_the_report_it_was_handed_and_an_armed_one_turns_applied_when_it_fires():
    report: dict[str, str] = {}
    status = Status("deepspeed", report)
    status.set("armed: applied when deepspeed is imported")
    status.child("deepspeed-extra").set("applied (one)")
    status.fired()
    assert report == {"deepspeed": "applied when deepspeed is imported", "deepspeed-extra": "applied (one)"}


# -- a third party's integration, from a wheel ---------------------------------------------------------------------

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "devshim-widgets"
version = "1.0.0"
dependencies = ["devshim-core>=0.1,<0.2"]

[project.entry-points."devshim.integrations"]
widgets = "devshim_widgets:INTEGRATION"
broken = "devshim_widgets.missing:INTEGRATION"

[tool.setuptools]
packages = ["devshim_widgets"]
"""

PACKAGE = '''\
"""A third party's integration: patches the 'widgets' framework (a module of this package) on devshim's device."""

from devshim_core.integrations.base import Integration
from devshim_core.patching import REGISTRY, PatchSet, SetAttribute


def device_name():  # the 'framework' function the integration patches
    return "cuda"


PATCHES = PatchSet("widgets", (), [SetAttribute("device-name", "devshim_widgets:device_name",
                                                lambda original, device: lambda: device.type, "on the device")],
                   "widgets on the selected device")


def install(device, settings, status):
    REGISTRY.apply(PATCHES, device)
    status.set("applied (widgets on " + device.type + ")")


INTEGRATION = Integration(name="widgets", reason="widgets on the selected device", install=install,
                          uninstall=lambda: REGISTRY.revert("widgets"), patch_sets=("widgets",))
'''

PROBE = """
import json, devshim_core.auto as auto, devshim_widgets
print(json.dumps({"integrations": auto.session.integrations, "device_name": devshim_widgets.device_name()}))
"""


@pytest.fixture(scope="module")
def widgets(tmp_path_factory):
    root = tmp_path_factory.mktemp("third_party_integration")
    source = root / "devshim-widgets"
    (source / "devshim_widgets").mkdir(parents=True)
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "devshim_widgets" / "__init__.py").write_text(PACKAGE)
    python, _ = layered_venv_with_wheel(root, source, "devshim_widgets-1.0.0-*.whl")
    env = clean_env(DEVSHIM_PLUGIN="cpu_reference")
    commands = Background({"probe": ([python, "-c", PROBE], env),
                           "disabled": ([python, "-c", PROBE], {**env, "DEVSHIM_DISABLE": "widgets"}),
                           "info": ([python, "-m", "devshim_core", "info", "--json"], env)})
    yield commands
    commands.close()


def test_a_third_party_integration_from_a_wheel_is_installed_after_devshims_own(widgets):
    result = widgets["probe"]
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["device_name"] == "cpu"
    assert list(report["integrations"])[-1] == "widgets"
    assert report["integrations"]["widgets"] == "applied (widgets on cpu)"
    # the broken entry point of the same wheel is left out, loudly, and stops nothing
    assert ("devshim: integration broken (devshim_widgets.missing:INTEGRATION) failed to load and is left out: "
            "ModuleNotFoundError") in result.stderr


def test_devshim_disable_turns_a_third_party_integration_off_by_its_name(widgets):
    result = widgets["disabled"]
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["device_name"] == "cuda"
    assert report["integrations"]["widgets"] == "skipped: DEVSHIM_DISABLE=widgets"


def test_devshim_info_reports_it_and_its_patch(widgets):
    info = checked_json(widgets["info"])
    assert info["integrations"]["widgets"] == "applied (widgets on cpu)"
    assert {"set": "widgets", "name": "device-name"} in [{"set": r["set"], "name": r["name"]} for r in info["patches"]]


def test_an_entry_that_is_not_an_integration_is_left_out(monkeypatch):
    class EntryPoint:
        name, value = "odd", "somewhere:thing"

        @staticmethod
        def load():
            return object()

    monkeypatch.setattr(table.metadata, "entry_points", lambda group: [EntryPoint()])
    assert table.third_party(set()) == []
    assert isinstance(table.builtin()[0], Integration)


def test_every_patch_set_name_follows_the_convention():
    """Lower-case words joined by '-' (a dotted module path may lead), never ':' (DEVSHIM_DISABLE's separator)."""
    from devshim_core.patching import NAME_PATTERN

    names = {name for integration in table.builtin() for name in integration.patch_sets}
    generated = (PROJECT_DIR / "docs" / "patches.md").read_text()
    names |= {line.split("|")[1].strip() for line in generated.splitlines()
              if line.startswith("| ") and not line.startswith("| set |")}
    assert names and sorted(n for n in names if not NAME_PATTERN.match(n)) == []


def test_devshim_integrations_lists_the_table_without_activating_anything():
    code = ("import json, sys\nfrom devshim_core import cli\nsys.argv = ['devshim', 'integrations', '--json']\n"
            "rc = cli.main()\nfrom devshim_core.patching import REGISTRY\n"
            "print(json.dumps({'rc': rc, 'active': 'devshim_core.session' in sys.modules and "
            "__import__('devshim_core.session').session.current() is not None, 'patches': REGISTRY.report()}))")
    from plugin_fixtures import PYTHON, run

    result = run([PYTHON, "-c", code], clean_env())
    assert result.returncode == 0, result.stderr
    *listing, last = result.stdout.strip().splitlines()
    rows = json.loads("\n".join(listing))
    assert [row["name"] for row in rows] == ["torch.distributed", "cuda-redirect", "deepspeed", "megatron",
                                             "checkpoints", "huggingface", "compare"]
    assert json.loads(last) == {"rc": 0, "active": False, "patches": []}
