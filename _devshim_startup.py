"""Run by ``devshim-auto.pth`` at interpreter start-up when DEVSHIM_AUTO is set (a top-level module of devshim-core's
wheel, outside the ``devshim_core`` package, so that loading it loads nothing else).

DEVSHIM_AUTO activates devshim in processes that never run the user's import line (launchers, spawned workers). Only
a process that imports torch can need devshim, so this module imports nothing heavy: it asks to be called back the
moment ``torch`` has finished importing, and activates then, inside that first ``import torch``, before the script's
next line runs. A process that never imports torch (``pip``, tools) pays for this one module alone: devshim's import
hook is loaded when torch is looked up (``python -m bench --only import_cost`` times the start-up against ``python
-c pass``). When torch's first import comes from a devshim module itself (``devshim info``, ``import
devshim_core.auto``), that caller activates. (DEVSHIM_EMULATE reaches processes that never import devshim through
devshim-emulation's ``torch.backends`` entry point, on ``import torch``.) A failure here must not take down every
Python process of the environment (pip included): it is printed, and the user's own ``import devshim_core.auto``
raises it again with the full traceback.
"""

import os
import sys

TYPE_CHECKING = False  # typing and types are not imported: every Python process of the environment runs this
if TYPE_CHECKING:
    from types import ModuleType


def _report(exc: Exception) -> None:
    print(f"devshim: DEVSHIM_AUTO is set but activation failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def _devshim_importing() -> bool:
    """Whether torch was first imported by devshim's own modules: activating inside their half-run imports would
    see them incomplete; ``import devshim_core.auto`` or ``devshim_core.activate()`` then activates instead."""
    return any(name.startswith("devshim") and getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()))


def _activate(torch: "ModuleType") -> None:
    if _devshim_importing():
        return
    try:
        import devshim_core.auto  # noqa: F401
    except Exception as exc:
        _report(exc)


class _WhenTorchIsLookedUp:
    """A meta-path finder that stays out of the way until ``torch`` is looked up, and only then imports devshim's
    import hook (:mod:`devshim_core.import_hooks`) and hands it the lookup: a process that never imports torch
    loads nothing more than this module. It stays in ``sys.meta_path``, inert, once it has fired: removing itself
    while the import system walks that list would make it skip the next finder."""

    armed = True

    @classmethod
    def find_spec(cls, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != "torch" or not cls.armed:
            return None
        cls.armed = False
        try:
            from devshim_core import import_hooks

            import_hooks.after_import("torch", _activate)
            return import_hooks.finder().find_spec(fullname, path, target)
        except Exception as exc:
            _report(exc)
            return None


try:
    # the .pth line let through any value but the false ones; the true ones pass here without importing anything,
    # and anything else gets parse_bool's error (a value that is no boolean is refused, not guessed)
    if os.environ.get("DEVSHIM_AUTO", "").strip().lower() in ("1", "true", "yes", "on"):
        sys.meta_path.insert(0, _WhenTorchIsLookedUp)  # type: ignore[arg-type]  # a finder by protocol
    else:
        from devshim_core.env_values import parse_bool

        parse_bool(os.environ, "DEVSHIM_AUTO", False)
except Exception as exc:
    _report(exc)
