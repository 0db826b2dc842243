"""The node writer (azcp_cluster/dest/nodewriter.py), on real files below tmp_path: O_DIRECT and
buffered writes, files created on arrival, runs of extents by directory, the journal, errors."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from zlib import crc32

import numpy as np
import pytest

from azcp_cluster.core.errors import LocalFSError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.schedule import DIRECT_MIN, Extent
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import ALIGN, aligned_buffer
from azcp_cluster.dest.localfs import temp_path
from azcp_cluster.dest.nodewriter import NodeWriter

BIG = 2 * DIRECT_MIN  # aligned and long enough: O_DIRECT where the filesystem allows it
FILES = [
    FileEntry(name="big.bin", path="big.bin", size=BIG),
    FileEntry(name="d/a.txt", path="d/a.txt", size=100),
    FileEntry(name="d/b.txt", path="d/b.txt", size=200),
    FileEntry(name="e/c.txt", path="e/c.txt", size=300),
    FileEntry(name="odd.bin", path="odd.bin", size=BIG + 123),
]


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    root = tmp_path / "dest"
    root.mkdir()
    return root


@pytest.fixture
def tree(dest: Path) -> Iterator[DestTree]:
    made = DestTree(str(dest))
    yield made
    made.close()


class Ends:
    """What the writer threads reported: each job's end, and the paths refused O_DIRECT."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.errors: list[BaseException | None] = []
        self.refused: list[str] = []

    def finished(self, error: BaseException | None) -> None:
        self.errors.append(error)
        self.done.set()

    def wait(self) -> BaseException | None:
        assert self.done.wait(10), "the write never ended"
        return self.errors[0]


def pattern(size: int, seed: int = 1) -> np.ndarray:
    """``size`` page-aligned bytes, each different from its neighbours."""
    buf = aligned_buffer(size)
    buf[:] = (np.arange(size, dtype=np.int64) * seed % 251).astype(np.uint8)
    return buf


def direct_refused_in(folder: Path) -> bool:
    """Whether the filesystem of ``folder`` refuses an O_DIRECT write (tmpfs does)."""
    if not hasattr(os, "O_DIRECT"):
        return True
    probe = folder / "probe"
    probe.write_bytes(b"")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_DIRECT)
    except OSError as exc:
        assert exc.errno in (errno.EINVAL, errno.EOPNOTSUPP)
        return True
    try:
        os.pwrite(fd, memoryview(aligned_buffer(ALIGN)), 0)  # type: ignore[arg-type]
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return True
    finally:
        os.close(fd)
        probe.unlink()
    return False


def test_a_large_aligned_extent_is_written_with_o_direct_where_the_filesystem_allows(
    tree: DestTree, dest: Path
) -> None:
    tree.prepare("big.bin", BIG)
    refused_here = direct_refused_in(dest.parent)
    buffer = pattern(BIG + ALIGN)
    ends = Ends()
    with NodeWriter(FILES, tree, 2) as writer:
        extent = Extent(0, 0, BIG, ALIGN, last_of_file=True)  # from an aligned place in the slot
        assert extent.direct
        writer.write_extents([extent], buffer, True, ends.finished, ends.refused.append)
        assert ends.wait() is None
    assert Path(temp_path(str(dest), "big.bin")).read_bytes() == bytes(buffer[ALIGN : ALIGN + BIG])
    # Refused (and said so, for the report's warning) exactly where the filesystem refuses it.
    assert bool(ends.refused) == refused_here


def test_buffered_writes_take_any_offset_and_length_and_never_ask_for_o_direct(tree: DestTree, dest: Path) -> None:
    tree.prepare("odd.bin", BIG + 123)
    buffer = pattern(BIG + 200, seed=3)
    ends = Ends()
    with NodeWriter(FILES, tree, 1) as writer:
        # A whole file's bytes from an unaligned place in the slot, with --no-bcast-direct.
        writer.write_extents([Extent(4, 0, BIG + 123, 77, True)], buffer, False, ends.finished, ends.refused.append)
        assert ends.wait() is None
    assert Path(temp_path(str(dest), "odd.bin")).read_bytes() == bytes(buffer[77 : 77 + BIG + 123])
    assert ends.refused == []


def test_the_download_opens_a_block_once_and_writes_its_buffers_into_it(tree: DestTree, dest: Path) -> None:
    tree.prepare("odd.bin", BIG + 123)
    first, last = pattern(BIG, seed=5), pattern(ALIGN, seed=7)
    ends = [Ends(), Ends()]
    with NodeWriter(FILES, tree, 2) as writer:
        target = writer.open(4)
        try:
            writer.write(target, first, 0, ends[0].finished)
            writer.write(target, last[:123], BIG, ends[1].finished)  # a file's unaligned tail
            assert [e.wait() for e in ends] == [None, None]
        finally:
            target.close()
    assert Path(temp_path(str(dest), "odd.bin")).read_bytes() == bytes(first) + bytes(last[:123])


def test_a_small_file_made_on_arrival_is_created_when_its_bytes_come(tree: DestTree, dest: Path) -> None:
    tree.prepare_all([("d/b.txt", 200)], later=["d/a.txt"])
    made = Path(temp_path(str(dest), "d/a.txt"))
    assert not made.exists()  # deferred: only its directory stands
    buffer = pattern(400, seed=11)
    ends = Ends()
    with NodeWriter(FILES, tree, 1, on_arrival={1}) as writer:
        extents = [Extent(1, 0, 100, 0, True), Extent(2, 0, 200, 100, True)]
        writer.write_extents(extents, buffer, True, ends.finished, ends.refused.append)
        assert ends.wait() is None
    assert made.read_bytes() == bytes(buffer[:100])
    assert Path(temp_path(str(dest), "d/b.txt")).read_bytes() == bytes(buffer[100:300])


def test_small_extents_are_walked_to_by_runs_of_one_directory_and_a_large_one_alone(tree: DestTree) -> None:
    writer = NodeWriter(FILES, tree, 1)
    try:
        a, b, c = Extent(1, 0, 100, 0, True), Extent(2, 0, 200, 100, True), Extent(3, 0, 300, 300, True)
        big = Extent(0, 0, BIG, 4 * ALIGN, True)
        again = Extent(2, 0, 10, 600, True)
        assert writer.by_directory([a, b, c, big, again]) == [
            (["d"], [a, b]),
            (["e"], [c]),
            (None, [big]),
            (["d"], [again]),  # runs are consecutive: a directory seen before is walked again
        ]
    finally:
        writer.close()


def test_every_extent_and_block_written_is_recorded_in_the_journal(tree: DestTree) -> None:
    tree.prepare_all([("big.bin", BIG), ("d/a.txt", 100), ("d/b.txt", 200), ("e/c.txt", 300)])
    recorded: list[tuple[int, int, int, int]] = []
    buffer = pattern(BIG + 2 * ALIGN)
    ends = Ends()
    extents = [Extent(1, 0, 100, 0, True), Extent(2, 0, 200, 100, True), Extent(3, 0, 300, 300, True)]
    with NodeWriter(FILES, tree, 1, journal=lambda *r: recorded.append(r)) as writer:
        writer.write_extents(extents, buffer, True, ends.finished, ends.refused.append)
        assert ends.wait() is None
        writer.written(Extent(0, 0, BIG, 0, True), buffer, True)  # a range recorded directly, from the source
    # Each with the CRC-32 of the bytes it was written from (what a rerun checks it by).
    crcs = [crc32(bytes(buffer[at : at + n])) for at, n in ((0, 100), (100, 200), (300, 300), (0, BIG))]
    # Received (write_extents' default), but for the one recorded as read from the source.
    assert recorded == [
        (1, 0, 100, crcs[0], False),
        (2, 0, 200, crcs[1], False),
        (3, 0, 300, crcs[2], False),
        (0, 0, BIG, crcs[3], True),
    ]
    assert len(set(crcs)) == 4


def test_a_failed_write_reaches_its_caller_named_and_is_not_recorded(tree: DestTree, dest: Path) -> None:
    tree.prepare("d/a.txt", 100)
    os.unlink(temp_path(str(dest), "d/a.txt"))  # gone from under the writer
    recorded: list[tuple[int, int, int, int]] = []
    ends = Ends()
    with NodeWriter(FILES, tree, 1, journal=lambda *r: recorded.append(r)) as writer:
        writer.write_extents([Extent(1, 0, 100, 0, True)], pattern(ALIGN), True, ends.finished, ends.refused.append)
        error = ends.wait()
        assert isinstance(error, LocalFSError)
        assert "cannot write" in str(error) and error.path == temp_path(str(dest), "d/a.txt")
        with pytest.raises(LocalFSError, match="open temporary file"):
            writer.open(1)
    assert recorded == []


def test_a_closed_writer_takes_no_more_writes(tree: DestTree) -> None:
    tree.prepare("big.bin", BIG)
    writer = NodeWriter(FILES, tree, 2)
    target = writer.open(0)
    try:
        writer.close()
        writer.close()  # idempotent
        assert writer.size == 0
        with pytest.raises(RuntimeError, match="closed"):
            writer.write(target, pattern(ALIGN), 0, lambda error: None)
    finally:
        target.close()
