"""The emulation's own error: a :class:`devshim_core.errors.ConfigError`, so ``devshim info`` and activation report
it as a setting to change (one line, exit status 2), like every other bad ``DEVSHIM_*`` value."""

from __future__ import annotations

from devshim_core.errors import ConfigError


class EmulationError(ConfigError):
    """Emulation was asked for in a way that cannot work; the message says what to change."""
