"""Run by ``devshim-auto.pth`` at interpreter start-up when DEVSHIM_AUTO is set.

DEVSHIM_AUTO activates devshim in processes that never run the user's import line (launchers, spawned
workers). The ``.pth`` line reads that one variable and nothing else; with it unset, nothing is imported.
(DEVSHIM_EMULATE reaches processes that never import devshim through ``devshim_torch_backend``, on ``import
torch``.) A failure here must not take down every Python process of the environment (pip included): it is
printed, and the user's own ``import devshim_core.auto`` raises it again with the full traceback.
"""

import os
import sys

try:
    from devshim_core.settings import parse_bool

    if parse_bool(os.environ, "DEVSHIM_AUTO", False):  # a value that is no boolean is refused, not guessed
        import devshim_core.auto  # noqa: F401
except Exception as exc:
    print(f"devshim: DEVSHIM_AUTO is set but activation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
