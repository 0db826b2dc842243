"""The root's read-ahead: a streaming root copies its transfers from what its download still
holds in memory, and reads from the disk whatever it does not hold or did not download."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.schedule import Extent, Transfer
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.fanout.readahead import ReadAhead

SIZE = 64 * 1024


class _Held:
    """What a streaming download's pool still holds: (file, offset) -> bytes; each copied once."""

    def __init__(self, held: dict[tuple[int, int], bytes]) -> None:
        self.held = held
        self.asked: list[tuple[int, int, int]] = []

    def copy_held(self, file: int, offset: int, out: np.ndarray) -> bool:
        self.asked.append((file, offset, len(out)))
        data = self.held.pop((file, offset), None)
        if data is None or len(data) != len(out):
            return False
        out[:] = np.frombuffer(data, dtype=np.uint8)
        return True


@pytest.fixture
def tree(tmp_path: Path) -> DestTree:
    dest = tmp_path / "dest"
    dest.mkdir()
    made = DestTree(str(dest))
    made.prepare_all([("got.bin", SIZE), ("had.bin", SIZE)])
    return made


def _reader(tree: DestTree, held: _Held | None) -> ReadAhead:
    files = [FileEntry("got.bin", "got.bin", SIZE), FileEntry("had.bin", "had.bin", SIZE)]
    schedule = [Transfer(0, 0, (1,), (Extent(0, 0, SIZE, 0, True),), True),
                Transfer(1, 0, (1,), (Extent(1, 0, SIZE, 0, True),), True)]  # fmt: skip
    return ReadAhead(files, tree, schedule, 0, have=[False, True], source_of=lambda i: None,
                     direct=False, hint_window=4, changed=set(), held=held)  # fmt: skip


def _fill(tree: DestTree, tmp_path: Path) -> None:
    """The download's temporary file of got.bin, and had.bin complete under its final name."""
    with open(tree.temp_shown("got.bin"), "r+b") as f:
        f.write(b"D" * SIZE)  # on the disk
    (tmp_path / "dest" / "had.bin").write_bytes(b"H" * SIZE)


def test_a_transfer_held_in_memory_is_copied_and_never_read_from_the_disk(tree: DestTree, tmp_path: Path) -> None:
    _fill(tree, tmp_path)
    os.unlink(tree.temp_shown("got.bin"))  # a read of the disk would fail now
    held = _Held({(0, 0): b"M" * SIZE})
    reader = _reader(tree, held)
    slot = np.zeros(SIZE + 1, dtype=np.uint8)
    reader.read(reader.schedule[0], slot)
    assert bytes(slot[:SIZE]) == b"M" * SIZE and reader.memory_bytes == SIZE
    reader.close()


def test_what_is_not_held_or_was_not_downloaded_is_read_from_the_disk(tree: DestTree, tmp_path: Path) -> None:
    _fill(tree, tmp_path)
    held = _Held({(1, 0): b"M" * SIZE})  # had.bin was never downloaded: whatever is held, its copy is the disk's
    reader = _reader(tree, held)
    slot = np.zeros(SIZE + 1, dtype=np.uint8)
    reader.read(reader.schedule[0], slot)
    assert bytes(slot[:SIZE]) == b"D" * SIZE  # not held: read back
    reader.read(reader.schedule[1], slot)
    assert bytes(slot[:SIZE]) == b"H" * SIZE
    assert reader.memory_bytes == 0 and held.asked == [(0, 0, SIZE)]  # had.bin was not even asked for
    reader.close()


def test_a_file_whose_last_extent_is_held_is_closed_after_its_earlier_ones_came_from_the_disk(
    tree: DestTree, tmp_path: Path
) -> None:
    _fill(tree, tmp_path)
    half = SIZE // 2
    held = _Held({(0, half): b"M" * half})
    files = [FileEntry("got.bin", "got.bin", SIZE), FileEntry("had.bin", "had.bin", SIZE)]
    transfer = Transfer(0, 0, (1,), (Extent(0, 0, half, 0, False), Extent(0, half, half, half, True)), True)
    reader = ReadAhead(files, tree, [transfer], 0, have=[False, True], source_of=lambda i: None,
                       direct=False, hint_window=4, changed=set(), held=held)  # fmt: skip
    slot = np.zeros(SIZE + 1, dtype=np.uint8)
    reader.read(transfer, slot)
    assert bytes(slot[:SIZE]) == b"D" * half + b"M" * half and reader.memory_bytes == half
    assert reader._current is None  # nothing more is read of it: its descriptor is not kept
