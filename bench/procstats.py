"""CPU time and memory of processes, read from ``/proc`` (Linux).

CPU per request is the CPU time (user + system, as ``/proc/<pid>/stat``'s ``utime``
and ``stime`` count it, in clock ticks of 1/``SC_CLK_TCK`` s) that the server's
processes spent during a run, divided by the requests answered. The processes are
the children of the given parents: the gunicorn workers (children of the master)
and the PostgreSQL processes (children of the postmaster: the backends serving the
app's connections, plus the WAL writer, checkpointer and the rest, whose work the
load causes too). The load generator is not counted.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICK = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``state`` first)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_ticks(pid: int) -> int | None:
    """User plus system CPU time of ``pid`` in clock ticks; ``None`` when it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return int(fields[11]) + int(fields[12])


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def command_of(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def children_of(parents: set[int]) -> list[int]:
    """The processes whose parent is one of ``parents``."""
    found = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            if parent_of(pid) in parents:
                found.append(pid)
    return sorted(found)


def machine_ticks() -> tuple[int, int]:
    """Busy and total CPU time of the whole machine so far, in clock ticks of all
    CPUs (``/proc/stat``: idle and iowait are not busy; guest time is already in user)."""
    fields = [int(v) for v in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for process {pid}")


class CpuMeter:
    """CPU time spent by the children of ``parents`` between two snapshots."""

    def __init__(self, parents: set[int]) -> None:
        self.parents = parents

    def snapshot(self) -> dict[int, int]:
        ticks = {}
        for pid in children_of(self.parents):
            value = cpu_ticks(pid)
            if value is not None:
                ticks[pid] = value
        return ticks

    @staticmethod
    def seconds_between(before: dict[int, int], after: dict[int, int]) -> float:
        """CPU seconds spent in between; a process started meanwhile counts from
        zero, one that ended meanwhile is lost (both rare: pools keep connections)."""
        return sum(ticks - before.get(pid, 0) for pid, ticks in after.items()) * CLOCK_TICK
