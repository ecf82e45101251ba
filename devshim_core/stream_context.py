"""The object ``torch.cuda.stream(s)`` returns, for every device: a context manager that can be entered again.

torch's ``StreamContext`` is reusable, and frameworks rely on it: Megatron's DDP bucket group builds one
``torch.cuda.stream(communication_stream)`` and enters it for the reduce-scatter and again for the all-reduce
across distributed-optimizer instances. A device module's ``stream`` may be a one-shot generator context
(``@contextlib.contextmanager``); each entry here opens a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


class StreamContext:
    """``with ctx:`` makes ``stream`` current through ``enter(stream)``, as often as it is entered (nested too)."""

    def __init__(self, enter: Callable[[Any], AbstractContextManager[Any]], stream: Any) -> None:
        self._enter = enter
        self.stream = stream
        self._open: list[AbstractContextManager[Any]] = []

    def __enter__(self) -> Any:
        context = self._enter(self.stream)
        entered = context.__enter__()
        self._open.append(context)
        return entered

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._open.pop().__exit__(*exc_info)


def reusable(enter: Callable[[Any], AbstractContextManager[Any]]) -> Callable[[Any], StreamContext]:
    """``stream(s)`` returning a :class:`StreamContext` over a device module's ``stream``."""

    def stream(stream: Any) -> StreamContext:
        return StreamContext(enter, stream)

    stream.__doc__ = "Make ``stream`` current inside ``with``; the context may be entered again."
    return stream
