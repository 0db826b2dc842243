"""tests/leftovers.py: what a session leaves is measured, and MPI segments no process holds are removed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import leftovers


@pytest.mark.skipif(not leftovers.SHM.is_dir(), reason="no /dev/shm")
def test_an_orphaned_segment_is_removed_and_one_in_use_or_older_or_young_is_kept() -> None:
    tag = f"azcptest{os.getpid()}"
    old = leftovers.SHM / f"mpich_shm_{tag}_old"  # there before the session: not this session's
    old.write_bytes(b"x" * 4096)
    before = leftovers.take(None)
    names = (f"mpich_shm_{tag}_0", f"sm_segment.{tag}.0", f"mpich_shm_{tag}_1", f"{tag}.other")
    orphan, held, young, other = (leftovers.SHM / n for n in names)
    for path in (orphan, held, young, other):
        path.write_bytes(b"x" * 8192)
    for path in (old, orphan, held, other):
        os.utime(path, (1, 1))  # long settled
    fd = os.open(held, os.O_RDONLY)  # held open by a process: this one
    try:
        leftovers.remove_orphan_segments(before)
        assert [p.exists() for p in (old, orphan, held, young, other)] == [True, False, True, True, True]
        assert before.removed == 1 and before.removed_bytes >= 8192
        line, over = leftovers.summary(before)
        assert "removed 1 orphaned MPI shared-memory segments" in line and not over
    finally:
        os.close(fd)
        for path in (old, orphan, held, young, other):
            path.unlink(missing_ok=True)


def test_the_summary_counts_the_base_directory_and_warns_above_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "pytest-7"
    base.mkdir()
    before = leftovers.take(base)
    with open(base / "big", "wb") as f:
        f.write(b"\0" * (2 * 2**20))
    assert leftovers.left(before)["basetemp"] >= 2 * 2**20
    line, over = leftovers.summary(before)
    assert line.startswith("left on disk: ") and not over
    monkeypatch.setattr(leftovers, "LIMIT", 2**20)
    line, over = leftovers.summary(before)
    assert over and "over 1 MiB" in line
