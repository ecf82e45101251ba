"""Reading one boolean environment switch, with nothing else imported: the ``DEVSHIM_AUTO`` start-up hook runs
this in every Python process of the environment."""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: importing typing would double the start-up hook's cost
if TYPE_CHECKING:
    from collections.abc import Mapping

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
    from devshim_core.errors import ConfigError  # only on this path: the start-up hook imports this module

    raise ConfigError(f"{name}={raw!r} is not a boolean: use 1 or 0 (also accepted: true/false, yes/no, on/off).")
