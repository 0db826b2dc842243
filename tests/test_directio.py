"""DirectFile: O_DIRECT for the aligned part of each write, ordinary writes for the rest."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from azcp_cluster import directio
from azcp_cluster.config import MiB
from azcp_cluster.directio import ALIGN, DirectFile, align_down, aligned_buffer


def _blank(path: Path, size: int) -> None:
    with open(path, "wb") as fh:
        fh.truncate(size)


def _filled(size: int, seed: int) -> np.ndarray:
    buf = aligned_buffer(size)
    buf[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return buf


def test_aligned_buffer_is_page_aligned_and_sized() -> None:
    for size in (1, ALIGN, 3 * ALIGN + 5, 1 << 20):
        buf = aligned_buffer(size)
        assert buf.shape == (size,)
        assert buf.ctypes.data % ALIGN == 0


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("tail", [0, 1, ALIGN - 1, 777])
def test_write_many_puts_every_byte_in_place(tmp_path: Path, direct: bool, tail: int) -> None:
    parts = [_filled(2 * ALIGN, 1), _filled(4 * ALIGN, 2), _filled(ALIGN + tail, 3)]
    offset = 3 * ALIGN
    size = offset + sum(p.shape[0] for p in parts)
    path = tmp_path / "f"
    _blank(path, size)
    target = DirectFile(str(path), direct=direct)
    try:
        assert target.write_many(parts, offset) == size - offset
    finally:
        target.close()
    data = path.read_bytes()
    assert len(data) == size
    assert data[:offset] == bytes(offset)
    assert data[offset:] == b"".join(p.tobytes() for p in parts)


def test_unaligned_offset_or_parts_fall_back_to_ordinary_writes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    _blank(path, 5 * ALIGN)
    part = _filled(2 * ALIGN, 4)
    target = DirectFile(str(path))
    try:
        target.write_at(part, 123)  # unaligned offset
        target.write_many([part[:100], part[100:]], 3 * ALIGN)  # first part not whole blocks
    finally:
        target.close()
    data = path.read_bytes()
    assert data[123 : 123 + 2 * ALIGN][: 3 * ALIGN - 123] == part.tobytes()[: 3 * ALIGN - 123]
    assert data[3 * ALIGN :] == part.tobytes()


def test_align_down() -> None:
    assert align_down(0) == 0
    assert align_down(ALIGN - 1) == 0
    assert align_down(ALIGN) == ALIGN
    assert align_down(3 * ALIGN + 7) == 3 * ALIGN


def test_direct_is_used_where_the_filesystem_allows(tmp_path: Path) -> None:
    path = tmp_path / "f"
    _blank(path, ALIGN)
    target = DirectFile(str(path))
    try:
        # ext4, xfs and tmpfs on current kernels take O_DIRECT; others fall back silently.
        assert target.is_direct == (target.direct_fd >= 0)
        assert target.fd >= 0
    finally:
        target.close()
    assert target.fd == -1 and target.direct_fd == -1
    assert os.path.getsize(path) == ALIGN


def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    path = tmp_path / "f"
    _blank(path, 2 * ALIGN)
    data = _filled(2 * ALIGN, 9)
    target = DirectFile(str(path))
    try:
        assert target.refused and not target.is_direct
        assert target.write_at(data, 0) == 2 * ALIGN
    finally:
        target.close()
    assert path.read_bytes() == data.tobytes()


def test_writes_refused_at_once_by_several_threads_fall_back_without_closing_a_shared_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that takes the O_DIRECT open but refuses the writes, hit by two writer threads together."""
    path = tmp_path / "f"
    _blank(path, 2 * MiB)
    target = DirectFile(str(path))
    if not target.is_direct:
        target.close()
        pytest.skip("this filesystem does not take O_DIRECT")
    direct_fd = target.direct_fd
    both = threading.Barrier(2)
    real = directio.pwritev_all

    def refusing(fd: int, views: list[memoryview], offset: int) -> int:
        if fd == direct_fd:
            both.wait(timeout=10)  # both threads are in the refused write before either reacts
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, views, offset)

    monkeypatch.setattr(directio, "pwritev_all", refusing)
    parts = [_filled(MiB, 11), _filled(MiB, 12)]
    errors: list[BaseException] = []

    def write(index: int) -> None:
        try:
            target.write_at(parts[index], index * MiB)
        except BaseException as exc:  # collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert target.refused and not target.is_direct
    assert target.direct_fd == direct_fd  # still open: another thread may have been using it
    target.close()
    assert target.direct_fd == -1 and target.fd == -1
    assert path.read_bytes() == parts[0].tobytes() + parts[1].tobytes()
