"""The CPUs this process may run on, and how busy they and this process are (Linux's /proc/stat).

Auto download workers (:class:`azcp_cluster.download.workers.AutoDownloader`) decide from what a rank
sees while it downloads: how much of a core it uses itself, and how many of its CPUs stay
idle meanwhile, whoever keeps the others busy (other ranks and their workers, a storage
emulator on the same machine, a training job starting).
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def allowed() -> list[int]:
    """The CPUs this process may run on (its affinity: Slurm's binding, ``taskset``), ascending."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Sample:
    """One reading: the clock, this process's CPU seconds (all its threads), and idle CPU seconds."""

    wall: float
    own: float
    idle: float | None  # summed over the CPUs asked about; None where /proc/stat cannot be read


def sample(cpus: list[int]) -> Sample:
    """Read the clock, this process's CPU time and the idle time of ``cpus`` now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return Sample(time.monotonic(), usage.ru_utime + usage.ru_stime, _idle_seconds(set(cpus)))


def _idle_seconds(cpus: set[int]) -> float | None:
    try:
        with open("/proc/stat", "rb") as fh:
            text = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    ticks = 0
    seen = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = rest.split()
        ticks += int(fields[3]) + int(fields[4])  # idle, iowait
        seen += 1
    return ticks / _TICK if seen else None


def busy(first: Sample, last: Sample) -> tuple[float, float | None]:
    """Between two samples: the cores this process kept busy, and the idle cores (None: unknown)."""
    wall = last.wall - first.wall
    if wall <= 0:
        return 0.0, None
    own = (last.own - first.own) / wall
    idle = None if first.idle is None or last.idle is None else max(0.0, (last.idle - first.idle) / wall)
    return own, idle


__all__ = ["Sample", "allowed", "busy", "sample"]
