"""A process's CPU time, parent and command line, read from Linux's ``/proc``.

The two benchmarks that watch a run's processes (``cpu_share.py``, by role in a
sweep; ``suite_cpu.py``, by kind in the test suite) read them here, so the
parsing pitfall below is handled once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """What ``/proc/<pid>/stat`` says of a process."""

    parent: int
    cpu_s: float  # user + system
    started: int  # clock ticks after boot


def parse_stat(text: str, ticks_per_s: float = TICKS_PER_S) -> ProcStat:
    """A ``/proc/<pid>/stat`` line. The command name in parentheses may hold
    spaces and parentheses itself, so the fields are counted from its last ``)``."""
    fields = text.rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3): ppid, utime, stime, starttime are fields 4, 14, 15, 22.
    return ProcStat(int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks_per_s, int(fields[19]))


def read_stat(pid: int | str, ticks_per_s: float = TICKS_PER_S) -> ProcStat | None:
    """``pid``'s stat, or ``None`` if it is gone (or its line cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read(), ticks_per_s)
    except (OSError, ValueError, IndexError):
        return None


def read_cmdline(pid: int | str, limit: int = -1) -> str:
    """``pid``'s command line, its arguments joined by spaces (``""`` if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(limit).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pids() -> list[int]:
    """Every process id ``/proc`` lists now."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
