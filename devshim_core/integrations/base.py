"""The :class:`Integration` record: one per framework devshim patches, listable without applying anything.

The model is OpenTelemetry's instrumentors: each integration says what it patches and for which versions, what it
needs from other integrations, and which imports fire the patch sets it arms; it installs and uninstalls itself, and
reports through the :class:`Status` the session hands it, never by importing the session. The session walks one
ordered table of them (:mod:`devshim_core.integrations.table`); third parties add theirs through the
``devshim.integrations`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from devshim_core.patching import Requirement

if TYPE_CHECKING:
    from devshim_core.device import Device
    from devshim_core.settings import Settings


class Status:
    """An integration's one-line status for ``devshim info``, written into the report it was handed.

    ``armed`` statuses name the module whose import applies them; :meth:`fired` turns them into ``applied`` when it
    does, so a report made later says what a script got."""

    def __init__(self, name: str, report: MutableMapping[str, str]) -> None:
        self.name = name
        self._report = report

    @property
    def text(self) -> str | None:
        return self._report.get(self.name)

    def set(self, text: str) -> None:
        self._report[self.name] = text

    def child(self, name: str) -> Status:
        """A status of its own in the same report, for an integration that reports several lines (one per set)."""
        return Status(name, self._report)

    def fired(self) -> None:
        """The module an ``armed: applied when ...`` status waited for was imported: the sets were applied."""
        text = self.text
        if text is not None and text.startswith("armed: applied"):
            self.set(text.replace("armed: applied", "applied", 1))


@dataclass(frozen=True)
class Integration:
    """One framework integration.

    ``install(device, settings, status)`` applies or arms its patch sets and reports through ``status``;
    ``uninstall()`` reverts them and cancels what is armed. ``applies(device, settings)`` says why it does not run
    here (``None``: it runs), before ``install`` is called: a device the frameworks support natively, a framework
    that is not installed. ``needs`` names integrations that must have been applied first; ``triggers`` the modules
    whose import fires the sets it arms; ``patch_sets`` the names of the sets it may apply (``devshim info`` and
    ``DEVSHIM_DISABLE`` use these names); ``framework`` the distribution and versions it supports.
    """

    name: str
    reason: str
    install: Callable[[Device, Settings, Status], None]
    uninstall: Callable[[], None]
    framework: Requirement | None = None
    needs: tuple[str, ...] = ()
    triggers: tuple[str, ...] = ()
    patch_sets: tuple[str, ...] = ()
    applies: Callable[[Device, Settings], str | None] = field(default=lambda device, settings: None)

    def describe(self) -> dict[str, Any]:
        """What the integration is, without applying anything (``devshim integrations``)."""
        return {"name": self.name, "reason": self.reason,
                "framework": None if self.framework is None else f"{self.framework.distribution}{self.framework.spec}",
                "needs": list(self.needs), "triggers": list(self.triggers), "patch_sets": list(self.patch_sets)}
