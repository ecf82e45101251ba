"""Host memory accounting: the process's resident set stands for "allocated", the machine's RAM for "total"."""

from __future__ import annotations

import os
import resource
from typing import Any

from devshim_core import AllocatorSpec

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the peak is the best the OS tells
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Peak:
    def __init__(self) -> None:
        self.value = _rss()

    def current(self, device: Any = None) -> int:
        now = _rss()
        self.value = max(self.value, now)
        return now

    def peak(self, device: Any = None) -> int:
        self.current()
        return self.value

    def reset(self, device: Any = None) -> None:
        self.value = _rss()

    def stats(self, device: Any = None) -> dict[str, int]:
        now = self.current()
        return {"allocated_bytes.all.current": now, "allocated_bytes.all.peak": self.value,
                "reserved_bytes.all.current": now, "reserved_bytes.all.peak": self.value}


def _total(device: Any = None) -> int:
    return os.sysconf("SC_PHYS_PAGES") * _PAGE


def _available(device: Any = None) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * _PAGE


def _empty_cache() -> None:
    return None  # the CPU allocator returns freed memory itself; there is no cache to drop


def allocator_spec() -> AllocatorSpec:
    peak = _Peak()
    return AllocatorSpec(memory_allocated=peak.current, max_memory_allocated=peak.peak,
                         memory_reserved=peak.current, max_memory_reserved=peak.peak,
                         reset_peak_memory_stats=peak.reset, memory_stats=peak.stats, empty_cache=_empty_cache,
                         total_memory=_total, available_memory=_available)
