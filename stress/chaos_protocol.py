"""The lines a chaos job prints and the harness reads: one ``chaos:`` line per event, parsed back by :func:`parse`.

Every rank prints ``started`` (with its pid, which the harness SIGKILLs) and ``finished``; rank 0 prints the rest.
Losses are printed with ``repr``, so the harness compares the exact floats the job computed.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_STARTED = re.compile(r"^chaos: rank (\d+) pid (\d+) started$")
_RESUMED = re.compile(r"^chaos: resumed (\S+) step (\d+)$")
_STEP = re.compile(r"^chaos: step (\d+) loss (\S+)$")
_SAVED = re.compile(r"^chaos: saved (\S+)$")
_FINISHED = re.compile(r"^chaos: rank (\d+) finished (\d+) steps; shared-memory collectives (\w+)$")


def job_arguments(description: str | None) -> argparse.Namespace:
    """The command line every chaos job takes: ``--steps``, ``--save-every``, ``--save-dir``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--save-dir", type=Path, required=True)
    return p.parse_args()


def _say(line: str) -> None:
    # one write(2) of a short line: the two ranks share the launcher's stdout, and print() writes the text and
    # the newline separately, so lines of two ranks could interleave
    os.write(1, f"chaos: {line}\n".encode())


def started(rank: int) -> None:
    _say(f"rank {rank} pid {os.getpid()} started")


def fresh() -> None:
    _say("fresh start")


def resumed(tag: str, step: int) -> None:
    _say(f"resumed {tag} step {step}")


def step(number: int, loss: float) -> None:
    _say(f"step {number} loss {loss!r}")


def saved(tag: str) -> None:
    _say(f"saved {tag}")


def shared_memory_used() -> str:
    """'yes' if this process maps a file of ``/dev/shm`` (devshim's shared-memory collectives keep their segment
    mapped until ``destroy_process_group``), else 'no'. Read from ``/proc/self/maps``, not from devshim's
    internals, so it holds whatever the collectives' implementation."""
    try:
        with open("/proc/self/maps") as maps:
            return "yes" if any(" /dev/shm/" in line for line in maps) else "no"
    except OSError:
        return "unknown"


def finished(rank: int, steps: int) -> None:
    _say(f"rank {rank} finished {steps} steps; shared-memory collectives {shared_memory_used()}")


@dataclass
class Events:
    """What one attempt printed, in order of the lines."""

    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    resumed_from: str | None = None  # the tag loaded, None for a fresh start (or no line)
    start_step: int | None = None
    losses: dict[int, float] = field(default_factory=dict)  # step (1-based) -> loss
    saved: list[str] = field(default_factory=list)
    finished: dict[int, str] = field(default_factory=dict)  # rank -> whether shared memory served a collective


def parse_line(line: str, events: Events) -> None:
    """Adds what ``line`` says to ``events``; other lines (the frameworks' logs) are ignored."""
    line = line.strip()
    if not line.startswith("chaos: "):
        return
    if m := _STARTED.match(line):
        events.pids[int(m[1])] = int(m[2])
    elif line == "chaos: fresh start":
        events.start_step = 0
    elif m := _RESUMED.match(line):
        events.resumed_from, events.start_step = m[1], int(m[2])
    elif m := _STEP.match(line):
        events.losses[int(m[1])] = float(m[2])
    elif m := _SAVED.match(line):
        events.saved.append(m[1])
    elif m := _FINISHED.match(line):
        events.finished[int(m[1])] = m[3]


def parse(text: str) -> Events:
    events = Events()
    for line in text.splitlines():
        parse_line(line, events)
    return events
