"""What a test session leaves on disk, measured and bounded (issue 41: a suite run left 8.4 GB).

pytest itself keeps only failed tests' ``tmp_path`` (``tmp_path_retention_policy = "failed"`` in
pyproject.toml) and removes the whole base directory after a run that passed. What it cannot see
are the shared-memory segments an MPI job leaves in /dev/shm when one of its processes is killed
before the segment is unlinked (MPICH's ``mpich_shm_*``, Open MPI's ``sm_segment.*``): 2 to 16 MiB
each, and the fault and signal tests kill ranks on purpose. A segment that appeared during this
session and that no process has open or mapped any more can never be attached again: it is removed.

At the end the session says what it leaves (its base directory and what of /dev/shm and the
temporary directory appeared meanwhile) and warns above :data:`LIMIT`. A warning, not a failure:
other runs on the same machine share /tmp and /dev/shm, and a failed run keeps its tests' files.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SHM = Path("/dev/shm")
SEGMENTS = ("mpich_shm_*", "sm_segment.*", "vader_segment.*")
LIMIT = 500 * 2**20
SETTLE_S = 10.0  # a segment younger than this may be between its creation and its first mapping


@dataclass
class Snapshot:
    """The entries of /dev/shm and of the temporary directory when the session started."""

    shm: set[str] = field(default_factory=set)
    tmp: set[str] = field(default_factory=set)
    basetemp: Path | None = None
    removed: int = 0
    removed_bytes: int = 0


def _names(directory: Path) -> set[str]:
    """The names in ``directory`` (none when it cannot be read)."""
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def take(basetemp: Path | None) -> Snapshot:
    """What is there now: the baseline against which the session's leftovers are measured."""
    return Snapshot(shm=_names(SHM), tmp=_names(Path(tempfile.gettempdir())), basetemp=basetemp)


def _in_use() -> set[str]:
    """Every /dev/shm path some process has open or mapped (what must not be removed)."""
    used: set[str] = set()
    for pid in filter(str.isdigit, _names(Path("/proc"))):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
        except OSError:
            continue  # gone, or not ours to read: its segments are then not removed either way below
        used.update(line.split(maxsplit=5)[5] for line in maps.splitlines() if " /dev/shm/" in line)
        for fd in _names(Path(f"/proc/{pid}/fd")):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                used.add(target)
    return used


def remove_orphan_segments(before: Snapshot) -> None:
    """Remove the MPI shared-memory segments that appeared since ``before`` and that no process uses."""
    new = [SHM / name for name in _names(SHM) - before.shm if any(Path(name).match(p) for p in SEGMENTS)]
    if not new:
        return
    used = _in_use()
    now = time.time()
    for path in new:
        try:
            info = path.lstat()
            if str(path) in used or now - info.st_mtime < SETTLE_S:
                continue
            path.unlink()
        except OSError:
            continue  # gone meanwhile, or not ours
        before.removed += 1
        before.removed_bytes += info.st_blocks * 512


def size_of(path: Path) -> int:
    """The bytes allocated under ``path`` (a file or a tree; links not followed, unreadable parts skipped)."""
    try:
        info = path.lstat()
    except OSError:
        return 0
    total = info.st_blocks * 512
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path, onerror=lambda _: None):
            for name in dirs + files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    continue
    return total


def left(before: Snapshot) -> dict[str, int]:
    """What the session leaves, in bytes: its base directory, and new /dev/shm and temporary-directory entries."""
    tmp = Path(tempfile.gettempdir())
    base = before.basetemp
    new_tmp = [tmp / n for n in _names(tmp) - before.tmp if base is None or tmp / n != base.parent]
    return {
        "basetemp": size_of(base) if base is not None else 0,
        "/dev/shm": sum(size_of(SHM / n) for n in _names(SHM) - before.shm),
        "tmp": sum(size_of(p) for p in new_tmp),
    }


def summary(before: Snapshot) -> tuple[str, bool]:
    """The session's line about what it leaves, and whether that is over :data:`LIMIT`."""
    sizes = left(before)
    total = sum(sizes.values())
    parts = ", ".join(f"{where} {size / 2**20:.0f} MiB" for where, size in sizes.items())
    line = f"left on disk: {total / 2**20:.0f} MiB ({parts})"
    if before.removed:
        freed = before.removed_bytes / 2**20
        line += f"; removed {before.removed} orphaned MPI shared-memory segments ({freed:.0f} MiB)"
    if total > LIMIT:
        line += f"; over {LIMIT // 2**20} MiB: a test or fixture leaves files outside tmp_path (tests/leftovers.py)"
    return line, total > LIMIT
