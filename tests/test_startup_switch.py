"""Spec: DEVSHIM_AUTO=1 activates devshim at interpreter start-up, through the ``devshim-auto.pth`` file that
devshim-core's wheels install, in processes that never run ``import devshim_core.auto`` themselves (the
deepspeed launcher, spawned workers). Unset, devshim is not even imported; and importing devshim_core, or
any of its modules but ``auto``, patches nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import site
from pathlib import Path

import pytest
from plugin_fixtures import PROJECT_DIR, PYTHON, Background, clean_env, run

ACCELERATOR_OF_AN_UNMODIFIED_SCRIPT = """\
import sys
print('devshim_core.session' in sys.modules)
from deepspeed.accelerator import get_accelerator
print(type(get_accelerator()).__name__)
"""

IMPORT_EVERYTHING_BUT_AUTO = """\
import json, pkgutil, sys
import devshim_core
skipped = {"devshim_core.auto", "devshim_core._startup", "devshim_core.__main__"}  # auto, and what runs it
imported = []
for info in pkgutil.walk_packages(devshim_core.__path__, "devshim_core."):
    if info.name not in skipped:
        __import__(info.name)
        imported.append(info.name)
from deepspeed.accelerator import get_accelerator
from devshim_core import import_hooks, session
from devshim_core.patching import REGISTRY
print(json.dumps({
    "imported": imported,
    "accelerator": type(get_accelerator()).__name__,
    "session": session.current() is not None,
    "patches": REGISTRY.report(),
    "import hook installed": import_hooks._FINDER in sys.meta_path,
}))
"""

COMMANDS = {
    "DEVSHIM_AUTO=1, unmodified script": ([PYTHON, "-c", ACCELERATOR_OF_AN_UNMODIFIED_SCRIPT],
                                          clean_env(DEVSHIM_AUTO="1")),
    "import everything but auto": ([PYTHON, "-c", IMPORT_EVERYTHING_BUT_AUTO], clean_env()),
    "DEVSHIM_AUTO=1, spawned workers": ([PYTHON, str(Path(__file__).parent / "plugin_fixtures" / "spawned_workers.py")],
                                        clean_env(DEVSHIM_AUTO="1")),
    "DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, pass": ([PYTHON, "-c", "pass"],
                                                clean_env(DEVSHIM_AUTO="1", DEVSHIM_PLUGIN="nope")),
    "DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, import auto": ([PYTHON, "-c", "import devshim_core.auto"],
                                                        clean_env(DEVSHIM_AUTO="1", DEVSHIM_PLUGIN="nope")),
}


@pytest.fixture(scope="module")
def started():
    commands = Background(COMMANDS)
    yield commands
    commands.close()


def test_the_startup_file_is_installed_in_site_packages_by_devshim_core_itself():
    [site_packages] = [Path(d) for d in site.getsitepackages() if (Path(d) / "devshim-auto.pth").exists()]
    [core] = [d for d in metadata.distributions(path=[str(site_packages)]) if d.metadata["Name"] == "devshim-core"]
    assert "devshim-auto.pth" in {str(f) for f in core.files or ()}  # in the wheel's RECORD: pip uninstall removes it
    text = (site_packages / "devshim-auto.pth").read_text()
    assert text == (PROJECT_DIR / "build_support" / "devshim-auto.pth").read_text()
    assert text.startswith("import ")  # site.py executes only .pth lines that start with "import"
    assert 'os.environ.get("DEVSHIM_AUTO", "")' in text and "devshim_core._startup" in text


def test_with_devshim_auto_set_an_unmodified_deepspeed_script_runs_on_devshims_accelerator(started):
    result = started["DEVSHIM_AUTO=1, unmodified script"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "DevshimAccelerator"]


def test_with_devshim_auto_set_spawn_and_forkserver_workers_run_on_devshims_accelerator(started):
    result = started["DEVSHIM_AUTO=1, spawned workers"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["spawn True DevshimAccelerator", "forkserver True DevshimAccelerator"]


@pytest.mark.parametrize("value", [None, "", "0"])
def test_without_devshim_auto_devshim_is_not_imported_at_all(value):
    env = clean_env() if value is None else clean_env(DEVSHIM_AUTO=value)
    result = run([PYTHON, "-c", "import sys; print(sorted(m for m in sys.modules if m.startswith('devshim')))"], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_importing_devshim_core_or_any_module_but_auto_patches_nothing(started):
    result = started["import everything but auto"]
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert {"devshim_core.session", "devshim_core.cli", "devshim_core.integrations.deepspeed.install",
            "devshim_core.integrations.deepspeed.patches"} <= set(report["imported"])
    assert report["accelerator"] != "DevshimAccelerator"
    assert report["session"] is False
    assert report["patches"] == []
    assert report["import hook installed"] is False


def test_a_failed_activation_at_startup_is_one_clear_line_and_does_not_break_python(started):
    """pip, the launcher, every Python process of the environment must keep working with a bad setting."""
    result = started["DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, pass"]
    assert result.returncode == 0
    assert result.stderr.startswith("devshim: DEVSHIM_AUTO is set but activation failed: SelectionError: "
                                    "DEVSHIM_PLUGIN names 'nope', which is not an installed devshim plugin.")
    assert "  - cpu_reference (devshim-cpu-reference 0.1.0): the host CPU is always available" in result.stderr
    assert "Traceback" not in result.stderr


def test_after_a_failed_startup_activation_the_scripts_own_import_raises_the_error_in_full(started):
    result = started["DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, import auto"]
    assert result.returncode == 1
    assert result.stderr.startswith("devshim: DEVSHIM_AUTO is set but activation failed: SelectionError")
    traceback = result.stderr[result.stderr.index("Traceback"):]
    assert "devshim_core.errors.SelectionError: DEVSHIM_PLUGIN names 'nope'" in traceback
