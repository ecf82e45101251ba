"""Spec: ``import_hooks.after_import(name, callback)`` runs ``callback(module)`` the moment ``name`` finishes
executing (before the importer gets it back), or right away when it already has."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
import textwrap
from pathlib import Path

import pytest

from devshim_core import import_hooks

_counter = itertools.count()


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """``modules.write(source, package=False) -> name``: a fresh, not yet imported module on ``sys.path``."""

    class Modules:
        def __init__(self) -> None:
            self.names: list[str] = []

        def write(self, source: str, *, package: bool = False) -> str:
            name = f"devshim_hook_target_{next(_counter)}"
            path = tmp_path / name / "__init__.py" if package else tmp_path / f"{name}.py"
            path.parent.mkdir(exist_ok=True)
            path.write_text(textwrap.dedent(source))
            self.names.append(name)
            return name

        def add(self, relative: str, source: str) -> None:
            path: Path = tmp_path / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))

    monkeypatch.syspath_prepend(str(tmp_path))
    found = Modules()
    yield found
    for name in found.names:
        import_hooks.cancel(name)
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_the_callback_runs_after_the_whole_module_body_has_executed(modules):
    name = modules.write("""
        FIRST = 1
        LAST = "the body ran to its end"
    """)
    seen = []
    assert import_hooks.after_import(name, lambda module: seen.append((module.__name__, module.LAST))) is False
    assert seen == []  # nothing imported yet
    module = importlib.import_module(name)
    assert seen == [(name, "the body ran to its end")]
    assert module.LAST == "the body ran to its end"


def test_the_callback_runs_before_the_importer_gets_the_module_back(modules):
    """A patch applied from the callback is in place before any ``from target import x`` binds ``x``."""
    target = modules.write("""
        def f():
            return "original"
    """)
    importer = modules.write(f"""
        from {target} import f
        BOUND_AT_IMPORT = f()
    """)
    import_hooks.after_import(target, lambda module: setattr(module, "f", lambda: "patched"))
    assert importlib.import_module(importer).BOUND_AT_IMPORT == "patched"


def test_an_already_imported_module_gets_the_callback_immediately(modules):
    name = modules.write("VALUE = 42\n")
    module = importlib.import_module(name)
    seen = []
    assert import_hooks.after_import(name, seen.append) is True
    assert seen == [module]


def test_every_callback_runs_once_in_registration_order(modules):
    name = modules.write("VALUE = 1\n")
    order = []
    import_hooks.after_import(name, lambda module: order.append("first"))
    import_hooks.after_import(name, lambda module: order.append("second"))
    importlib.import_module(name)
    importlib.reload(sys.modules[name])
    assert order == ["first", "second"]


def test_a_submodule_of_a_package_can_be_waited_for(modules):
    package = modules.write("", package=True)
    modules.add(f"{package}/accelerator.py", "READY = True\n")
    seen = []
    import_hooks.after_import(f"{package}.accelerator", lambda module: seen.append(module.READY))
    importlib.import_module(package)
    assert seen == []  # the package alone does not import the submodule
    importlib.import_module(f"{package}.accelerator")
    assert seen == [True]


def test_a_cancelled_callback_never_runs(modules):
    name = modules.write("VALUE = 1\n")
    seen = []
    import_hooks.after_import(name, seen.append)
    import_hooks.cancel(name)
    importlib.import_module(name)
    assert seen == []


def test_looking_a_module_up_without_importing_it_does_not_consume_the_callback(modules):
    """``importlib.util.find_spec`` (tools probing what is installed) finds a spec that is never executed."""
    name = modules.write("VALUE = 1\n")
    seen = []
    import_hooks.after_import(name, lambda module: seen.append(module.VALUE))
    assert importlib.util.find_spec(name) is not None
    assert seen == []
    importlib.import_module(name)
    assert seen == [1]


def test_a_module_whose_import_fails_keeps_its_callback_for_the_next_attempt(modules, tmp_path):
    name = modules.write("raise ImportError('not yet')\n")
    seen = []
    import_hooks.after_import(name, lambda module: seen.append(module.VALUE))
    with pytest.raises(ImportError, match="not yet"):
        importlib.import_module(name)
    (tmp_path / f"{name}.py").write_text("VALUE = 'second attempt'\n")
    importlib.invalidate_caches()
    importlib.import_module(name)
    assert seen == ["second attempt"]


def test_the_wrapped_loader_still_answers_what_tools_ask_a_loader(modules):
    name = modules.write("VALUE = 1\n")
    import_hooks.after_import(name, lambda module: None)
    module = importlib.import_module(name)
    assert module.__loader__.get_source(name) == "VALUE = 1\n"


def test_is_imported_is_false_for_a_module_that_is_not_in_sys_modules(modules):
    name = modules.write("VALUE = 1\n")
    assert import_hooks.is_imported(name) is False
    importlib.import_module(name)
    assert import_hooks.is_imported(name) is True


def test_another_thread_importing_the_module_while_a_callback_runs_gets_it_without_waiting(modules):
    """devshim activates inside the first ``import torch`` (DEVSHIM_AUTO), and each plugin's detection runs on a
    thread of its own that imports torch again: it must get the finished module, not wait for the import that runs
    the callback (a deadlock until the detection time limit)."""
    import threading

    name = modules.write("VALUE = 42\n")
    seen: list[object] = []

    def callback(module):
        worker = threading.Thread(target=lambda: seen.append(importlib.import_module(name).VALUE), daemon=True)
        worker.start()
        worker.join(10)
        seen.append("joined" if not worker.is_alive() else "still waiting")
        seen.append(import_hooks.is_imported(name))

    import_hooks.after_import(name, callback)
    importlib.import_module(name)
    assert seen == [42, "joined", True]
