"""Run by ``devshim-auto.pth`` at interpreter start-up when DEVSHIM_AUTO is on (launchers, spawned workers).

A failure here must not take down every Python process of the environment (pip included): it is
printed, and the user's own ``import devshim_core.auto`` raises it again with the full traceback.
"""

import sys

try:
    from devshim_core.settings import parse_bool

    if parse_bool(__import__("os").environ, "DEVSHIM_AUTO", False):
        import devshim_core.auto  # noqa: F401
except Exception as exc:
    print(f"devshim: DEVSHIM_AUTO is set but activation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
