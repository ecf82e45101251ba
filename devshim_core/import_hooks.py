"""Run a callback the moment a given module finishes executing (or now, if it already has).

Frameworks bind references at import time; a patch that must land before those bindings happen
(DeepSpeed's accelerator before its op builders are bound) is applied from here.
"""

from __future__ import annotations

import _thread  # not threading, nor typing below: the DEVSHIM_AUTO start-up hook imports this in every process
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import importlib.abc
    import importlib.machinery
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

    Callback = Callable[[ModuleType], None]


def is_imported(name: str) -> bool:
    """Whether ``name`` is in ``sys.modules`` and has finished executing."""
    module = sys.modules.get(name)
    if module is None:
        return False
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


class _Loader:  # the import system's loader protocol; importlib.abc is not imported (start-up cost)
    def __init__(self, wrapped: importlib.abc.Loader, name: str) -> None:
        self._wrapped = wrapped
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        # taken only now, not when the spec was found: a probe (importlib.util.find_spec) that never
        # executes the module must not consume them, and a failed import leaves them waiting
        with _FINDER._lock:
            callbacks = _FINDER.pending.pop(self._name, [])
        if callbacks:
            # the module has run to its end: mark it initialised now, as the import system will when this returns, so
            # that another thread importing it while a callback runs (a plugin's detection on its worker thread,
            # when devshim activates inside the first `import torch`) gets it instead of waiting on this import
            spec = getattr(module, "__spec__", None)
            if spec is not None:
                spec._initializing = False
        for callback in callbacks:
            callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tools that ask
        return getattr(self._wrapped, name)


class _Finder:  # a meta-path finder by protocol, for the same reason
    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}
        self._lock = _thread.allocate_lock()
        self._resolving = _thread._local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending or getattr(self._resolving, "active", False):
            return None
        self._resolving.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._resolving.active = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, fullname)  # type: ignore[assignment]  # a Loader by protocol
        return spec


_FINDER = _Finder()


def finder() -> _Finder:
    """The meta-path finder that runs the callbacks (for a finder that hands it a lookup)."""
    return _FINDER


def after_import(name: str, callback: Callback) -> bool:
    """Call ``callback(module)`` once ``name`` has executed. Returns True if it ran right away."""
    if is_imported(name):
        callback(sys.modules[name])
        return True
    with _FINDER._lock:
        _FINDER.pending.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return False


def cancel(name: str) -> None:
    """Forget callbacks still waiting for ``name``."""
    with _FINDER._lock:
        _FINDER.pending.pop(name, None)
