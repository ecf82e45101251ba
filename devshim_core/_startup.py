"""Run by ``devshim-auto.pth`` at interpreter start-up when DEVSHIM_AUTO is set.

DEVSHIM_AUTO activates devshim in processes that never run the user's import line (launchers, spawned
workers). Only a process that imports torch can need devshim, so this module imports nothing heavy: it asks to be
called back the moment ``torch`` has finished importing, and activates then, inside that first ``import torch``,
before the script's next line runs. A process that never imports torch (``pip``, tools) pays for this module and
the import hook alone. When torch's first import comes from a devshim module itself (``devshim info``, ``import
devshim_core.auto``), that caller activates. (DEVSHIM_EMULATE reaches processes that never import devshim through
devshim-emulation's ``torch.backends`` entry point, on ``import torch``.) A failure here must not take down every
Python process of the environment (pip included): it is printed, and the user's own ``import devshim_core.auto``
raises it again with the full traceback.
"""

import os
import sys
from types import ModuleType


def _report(exc: Exception) -> None:
    print(f"devshim: DEVSHIM_AUTO is set but activation failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def _devshim_importing() -> bool:
    """Whether torch was first imported by devshim's own modules: activating inside their half-run imports would
    see them incomplete; ``import devshim_core.auto`` or ``devshim_core.activate()`` then activates instead."""
    return any(name.startswith("devshim") and getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()))


def _activate(torch: ModuleType) -> None:
    if _devshim_importing():
        return
    try:
        import devshim_core.auto  # noqa: F401
    except Exception as exc:
        _report(exc)


try:
    from devshim_core.env_values import parse_bool

    if parse_bool(os.environ, "DEVSHIM_AUTO", False):  # a value that is no boolean is refused, not guessed
        from devshim_core import import_hooks

        import_hooks.after_import("torch", _activate)
except Exception as exc:
    _report(exc)
