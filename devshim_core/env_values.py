"""Reading one boolean environment switch, with nothing else imported: the ``DEVSHIM_AUTO`` start-up hook runs
this in every Python process of the environment."""

from __future__ import annotations

from collections.abc import Mapping

from devshim_core.errors import ConfigError

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use 1 or 0 (also accepted: true/false, yes/no, on/off).")
