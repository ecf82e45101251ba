"""Run by ``devshim-auto.pth`` at interpreter start-up when DEVSHIM_AUTO or DEVSHIM_EMULATE is set.

DEVSHIM_AUTO activates devshim in processes that never run the user's import line (launchers, spawned
workers); DEVSHIM_EMULATE makes the simulated vendor SDK importable in every process, devshim's or not.
A failure here must not take down every Python process of the environment (pip included): it is
printed, and the user's own ``import devshim_core.auto`` raises it again with the full traceback.
"""

import os
import sys

try:
    if os.environ.get("DEVSHIM_EMULATE", "").strip():
        from devshim_core.emulation import install_sdk, requested_vendor

        _vendor = requested_vendor()
        if _vendor is not None:
            install_sdk(_vendor)
except Exception as exc:
    print(f"devshim: DEVSHIM_EMULATE is set but the simulated SDK was not installed: {type(exc).__name__}: {exc}",
          file=sys.stderr)

try:
    from devshim_core.settings import parse_bool

    if parse_bool(os.environ, "DEVSHIM_AUTO", False):
        import devshim_core.auto  # noqa: F401
except Exception as exc:
    print(f"devshim: DEVSHIM_AUTO is set but activation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
