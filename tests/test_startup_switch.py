"""Spec: DEVSHIM_AUTO=1 activates devshim, through the ``devshim-auto.pth`` file that devshim-core's wheels install,
in processes that never run ``import devshim_core.auto`` themselves (the deepspeed launcher, spawned workers): the
moment such a process has imported torch, before its next line runs. A process that never imports torch (pip, tools)
costs no more than a few small modules. Unset, devshim is not even imported; and importing devshim_core, or any of its
modules but ``auto``, patches nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import site
from pathlib import Path

import pytest
from plugin_fixtures import PROJECT_DIR, PYTHON, Background, checked_json, clean_env, run

ACCELERATOR_OF_AN_UNMODIFIED_SCRIPT = """\
import sys
print('devshim_core.session' in sys.modules)
import torch
from devshim_core import active_session
print(active_session() is not None)
from deepspeed.accelerator import get_accelerator
print(type(get_accelerator()).__name__)
"""

IMPORT_EVERYTHING_BUT_AUTO = """\
import json, pkgutil, sys
import devshim_core
skipped = {"devshim_core.auto", "devshim_core.__main__"}  # auto, and what runs it
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
    "DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, import torch": ([PYTHON, "-c", "import torch; print('ok')"],
                                                        clean_env(DEVSHIM_AUTO="1", DEVSHIM_PLUGIN="nope")),
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
    assert 'os.environ.get("DEVSHIM_AUTO", "")' in text and "_devshim_startup" in text


def test_with_devshim_auto_set_an_unmodified_deepspeed_script_runs_on_devshims_accelerator(started):
    result = started["DEVSHIM_AUTO=1, unmodified script"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "DevshimAccelerator"]


def test_with_devshim_auto_set_a_process_that_never_imports_torch_imports_neither_torch_nor_devshims_core():
    """``python -X importtime -c pass``: what the start-up file costs a process such as pip."""
    result = run([PYTHON, "-X", "importtime", "-c", "pass"], clean_env(DEVSHIM_AUTO="1"))
    assert result.returncode == 0, result.stderr
    rows = [line.split("|") for line in result.stderr.splitlines()
            if line.startswith("import time:") and "imported package" not in line]
    cumulative = {row[2].strip(): int(row[1]) for row in rows}
    assert "torch" not in cumulative and "pluggy" not in cumulative and "devshim_core.session" not in cumulative
    devshim = sorted(name for name in cumulative if name.startswith(("devshim", "_devshim")))
    # one module of devshim's, outside its package, that imports nothing: devshim's import hook is loaded only
    # when torch is looked up (bench/import_cost.py times what this costs against python -c pass)
    assert devshim == ["_devshim_startup"]


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


PTH_LINE_UNDER_WATCH = """\
import json, os, sys
class Watched(dict):
    read = []
    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)
    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)
    def __contains__(self, key):
        self.read.append(key)
        return super().__contains__(key)
before = set(sys.modules)
os.environ = Watched(os.environ)
exec(open(sys.argv[1]).read())
print(json.dumps({"read": Watched.read, "imported": sorted(set(sys.modules) - before)}))
"""


def test_with_devshim_auto_unset_the_startup_line_reads_that_one_variable_and_imports_nothing():
    pth = PROJECT_DIR / "build_support" / "devshim-auto.pth"
    assert len(pth.read_text().splitlines()) == 1
    report = checked_json(run([PYTHON, "-S", "-c", PTH_LINE_UNDER_WATCH, pth], clean_env()))
    assert report == {"read": ["DEVSHIM_AUTO"], "imported": []}


def test_python_x_importtime_shows_the_installed_startup_file_importing_nothing_without_devshim_auto():
    """The installed file, processed by ``site`` as at start-up, against ``site`` processing nothing (``-S``
    keeps the other .pth files, such as the editable installs' finders, out of both runs)."""
    [site_packages] = [d for d in site.getsitepackages() if (Path(d) / "devshim-auto.pth").exists()]

    def imported(code: str) -> set[str]:
        result = run([PYTHON, "-S", "-X", "importtime", "-c", code], clean_env())
        assert result.returncode == 0, result.stderr
        return {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "imported package" not in line}

    baseline = imported("import site")
    with_the_file = imported(f"import site; site.addpackage({site_packages!r}, 'devshim-auto.pth', set())")
    assert "site" in baseline
    assert with_the_file - baseline == set()


def test_devshim_emulate_reaches_a_process_that_imports_torch_but_never_devshim():
    script = ("import importlib.util, sys; import torch; "
              "print(importlib.util.find_spec('torch_npu') is not None, "
              "sorted(m for m in sys.modules if m.startswith('devshim_core'))[:1])")
    emulated = run([PYTHON, "-c", script], clean_env(DEVSHIM_EMULATE="ascend"))
    assert emulated.returncode == 0, emulated.stderr
    assert emulated.stdout.split()[0] == "True"  # the simulated SDK, installed by torch's backend autoload
    plain = run([PYTHON, "-c", script], clean_env())
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "False []"  # unset: import torch imports nothing of devshim_core
    off = run([PYTHON, "-c", script], clean_env(DEVSHIM_EMULATE="ascend", TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert off.stdout.split()[0] == "False"  # PyTorch's own switch turns the autoload off


def test_a_bad_devshim_emulate_never_breaks_import_torch():
    result = run([PYTHON, "-c", "import torch; print('ok')"], clean_env(DEVSHIM_EMULATE="nvidia"))
    assert result.returncode == 0 and result.stdout.strip() == "ok"
    assert result.stderr.startswith("devshim: DEVSHIM_EMULATE is set but the simulated SDK was not installed: "
                                    "EmulationError: DEVSHIM_EMULATE='nvidia' names no emulated vendor")


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
    """pip, the launcher, every Python process of the environment must keep working with a bad setting; one that
    never imports torch does not even activate."""
    assert started["DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, pass"].returncode == 0
    assert started["DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, pass"].stderr == ""
    result = started["DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, import torch"]
    assert result.returncode == 0 and result.stdout == "ok\n"
    assert result.stderr.startswith("devshim: DEVSHIM_AUTO is set but activation failed: SelectionError: "
                                    "DEVSHIM_PLUGIN names 'nope', which is not an installed devshim plugin.")
    assert "  - cpu_reference (devshim-cpu-reference 0.1.0): the host CPU is always available" in result.stderr
    assert "Traceback" not in result.stderr


def test_with_a_bad_setting_the_scripts_own_import_raises_the_error_in_full(started):
    result = started["DEVSHIM_AUTO=1, bad DEVSHIM_PLUGIN, import auto"]
    assert result.returncode == 1
    traceback = result.stderr[result.stderr.index("Traceback"):]
    assert "devshim_core.errors.SelectionError: DEVSHIM_PLUGIN names 'nope'" in traceback


def test_with_devshim_auto_set_devshim_activates_even_when_its_import_hook_was_in_use_before_torch():
    """The start-up finder hands torch's lookup to devshim's import hook; when that hook already sits in
    ``sys.meta_path`` (something imported a devshim module that waits for a framework before torch), the lookup
    still reaches it once, and every other finder still gets its turn (a module only the last finder knows)."""
    script = """\
import importlib.abc, importlib.util, sys
from devshim_core import import_hooks
import_hooks.after_import("json", lambda module: None)  # json is imported already: runs now, no finder kept
import_hooks.after_import("never_imported_module", lambda module: None)  # keeps devshim's finder in sys.meta_path

class Last(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "only_the_last_finder_knows" else None
    def exec_module(self, module):
        module.found_by = "the last finder"

sys.meta_path.append(Last())
import torch
from devshim_core import active_session
print(active_session() is not None)
import only_the_last_finder_knows
print(only_the_last_finder_knows.found_by)
"""
    result = run([PYTHON, "-c", script], clean_env(DEVSHIM_AUTO="1", DEVSHIM_PLUGIN="cpu_reference"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True", "the last finder"]
