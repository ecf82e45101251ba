"""Streams and events for devices whose work is complete when the host call returns (the CPU).

Frameworks written for CUDA create side streams, wait on events and time regions with them. On a
host-synchronous device ordering is automatic, so these objects only keep the bookkeeping honest: a
``with stream(s)`` context makes ``s`` current, an event records the host clock and reports real
elapsed times, and every wait or query is already satisfied.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any


class HostStream:
    """A stream on which every operation has already completed."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = device
        self.priority = priority

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = event if event is not None else HostEvent()
        event.record(self)
        return event


class HostEvent:
    """An event that timestamps the host clock when recorded; ``elapsed_time`` is in milliseconds."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False, **kwargs: Any) -> None:  # torch.cuda.Event's parameters, in its order
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: HostEvent) -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("both events must be recorded before elapsed_time() is asked")
        return (end_event._time - self._time) * 1000.0


class HostStreams:
    """The per-thread current stream, starting at one default stream, as CUDA's API presents it."""

    def __init__(self) -> None:
        self._default = HostStream()
        self._local = threading.local()

    def current_stream(self, device: Any = None) -> HostStream:
        return getattr(self._local, "stream", self._default)

    def default_stream(self, device: Any = None) -> HostStream:
        return self._default

    @contextlib.contextmanager
    def stream(self, stream: HostStream | None) -> Iterator[HostStream | None]:
        previous = self.current_stream()
        if stream is not None:
            self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous
