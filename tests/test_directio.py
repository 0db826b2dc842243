"""directio: aligned (huge-page) buffers; O_DIRECT for the aligned part of each write and read."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.dest import directio
from azcp_cluster.dest.directio import (
    ALIGN,
    HUGE_PAGE,
    DirectFile,
    DirectReader,
    align_down,
    aligned_buffer,
    aligned_buffers,
    populate_pages,
)
from tests.conftest import cached_pages, fstype


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


def _setting(path: str) -> str:
    """The chosen value of a kernel setting such as ``always [madvise] never``, or "" without it."""
    try:
        text = Path(path).read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def _huge_pages_on_request() -> bool:
    """Whether this process gets 2 MiB transparent huge pages for regions that ask for them."""
    thp = "/sys/kernel/mm/transparent_hugepage"
    top = _setting(f"{thp}/enabled")
    per_size = _setting(f"{thp}/hugepages-2048kB/enabled")  # kernels 6.8+; "inherit" follows the top
    mode = top if per_size in ("", "inherit") else per_size
    status = Path("/proc/self/status").read_text()
    disabled = "THP_enabled:\t0" in status  # prctl(PR_SET_THP_DISABLE), set by some container runtimes
    return mode in ("always", "madvise") and not disabled


def _smaps_field(address: int, field: str) -> int:
    """A numeric field (``AnonHugePages``, ``THPeligible``) of this process's mapping holding ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and first == f"{field}:":
            return int(line.split()[1])
    raise AssertionError(f"no {field} for a mapping holding {address:#x}")


def test_a_large_buffer_sits_on_huge_page_boundaries_and_reads_zero() -> None:
    size = 2 * HUGE_PAGE + 5 * ALIGN  # not a whole number of huge pages: the rest is small pages
    buf = aligned_buffer(size, populate=True)
    assert buf.shape == (size,)
    assert buf.ctypes.data % HUGE_PAGE == 0
    assert not buf.any()
    buf[:] = 7  # writable, all of it
    assert int(buf[-1]) == 7


@pytest.mark.skipif(not _huge_pages_on_request(), reason="the kernel gives no huge pages on request here")
def test_a_large_buffer_asks_for_huge_pages() -> None:
    """O_DIRECT from huge pages hands the device one segment per 2 MiB, not per 4 KiB page."""
    buf = aligned_buffer(4 * HUGE_PAGE, populate=True)
    # Under "madvise" (the usual default) only a region that asks is eligible.
    assert _smaps_field(buf.ctypes.data, "THPeligible") == 1
    # Whether it got them depends on free memory too (the kernel falls back to small pages
    # when it finds no free 2 MiB): checked where it did, as on an idle test machine.
    if _smaps_field(buf.ctypes.data, "AnonHugePages") == 0:
        pytest.skip("eligible, but the kernel found no free huge page")


def test_buffers_cut_from_one_mapping_are_aligned_and_apart() -> None:
    size = HUGE_PAGE + 100  # not a whole number of pages: each buffer starts on the next page
    bufs = aligned_buffers(size, 5, populate=True)
    assert [b.shape for b in bufs] == [(size,)] * 5
    assert all(b.ctypes.data % ALIGN == 0 for b in bufs)
    starts = sorted(b.ctypes.data for b in bufs)
    assert all(b - a >= size for a, b in itertools.pairwise(starts))  # no overlap
    for i, b in enumerate(bufs):
        b[:] = i
    assert [int(b.min()) for b in bufs] == [int(b.max()) for b in bufs] == list(range(5))
    if _huge_pages_on_request():
        assert _smaps_field(bufs[0].ctypes.data, "THPeligible") == 1


def test_a_small_buffer_is_page_aligned_without_huge_page_padding() -> None:
    buf = aligned_buffer(HUGE_PAGE - ALIGN, populate=True)
    assert buf.ctypes.data % ALIGN == 0 and buf.shape == (HUGE_PAGE - ALIGN,)
    assert not buf.any()


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


@pytest.fixture
def no_direct_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses O_DIRECT at open (EINVAL), as some FUSE mounts and old tmpfs do."""
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)


@pytest.mark.usefixtures("no_direct_open")
def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(tmp_path: Path) -> None:
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


# ---------------------------------------------------------------------------------------
# DirectReader


def _file_of(path: Path, size: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("tail", [0, 1, ALIGN - 1, 777])
def test_read_at_returns_exactly_the_asked_bytes(tmp_path: Path, direct: bool, tail: int) -> None:
    """A chunk in the middle of the file and the file's last chunk, whose end is unaligned."""
    size = 6 * ALIGN + tail
    path = tmp_path / "f"
    data = _file_of(path, size, tail)
    buf = aligned_buffer(8 * ALIGN)
    buf[:] = 0xEE
    reader = DirectReader(str(path), direct=direct)
    try:
        if fstype(tmp_path) in ("ext4", "xfs", "btrfs"):
            assert reader.is_direct == direct
        assert reader.read_at(buf, 2 * ALIGN + 100, ALIGN) == 2 * ALIGN + 100  # mid-file, unaligned length
        assert buf[: 2 * ALIGN + 100].tobytes() == data[ALIGN : 3 * ALIGN + 100]
        assert reader.read_at(buf, 2 * ALIGN + tail, 4 * ALIGN) == 2 * ALIGN + tail  # the file's last chunk
        assert buf[: 2 * ALIGN + tail].tobytes() == data[4 * ALIGN :]
        assert reader.read_at(buf, 3 * ALIGN, 4 * ALIGN) == 2 * ALIGN + tail  # asked past the end: short
        assert reader.read_at(buf, ALIGN, size + ALIGN) == 0
    finally:
        reader.close()
    assert reader.fd == -1 and reader.direct_fd == -1


def test_read_at_an_unaligned_offset_or_into_a_tight_buffer_reads_through_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = _file_of(path, 4 * ALIGN + 10, 3)
    reader = DirectReader(str(path))
    try:
        buf = aligned_buffer(4 * ALIGN)
        assert reader.read_at(buf, 2 * ALIGN, 100) == 2 * ALIGN
        assert buf[: 2 * ALIGN].tobytes() == data[100 : 100 + 2 * ALIGN]
        tight = aligned_buffer(ALIGN + 10)  # no room for the whole last block
        assert reader.read_at(tight, ALIGN + 10, 3 * ALIGN) == ALIGN + 10
        assert tight.tobytes() == data[3 * ALIGN :]
        odd = aligned_buffer(3 * ALIGN)[1:]  # an unaligned address
        assert reader.read_at(odd, ALIGN, 0) == ALIGN
        assert odd[:ALIGN].tobytes() == data[:ALIGN]
    finally:
        reader.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_direct_read_leaves_the_page_cache_alone(tmp_path: Path, direct: bool) -> None:
    """Reading back this run's O_DIRECT downloads does not copy them through the cache."""
    if fstype(tmp_path) not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{fstype(tmp_path)}: not a block filesystem, every page of it is cache")
    size = 64 * ALIGN
    path = tmp_path / "f"
    _blank(path, size)
    writer = DirectFile(str(path))
    try:
        writer.write_at(_filled(size, 5), 0)
    finally:
        writer.close()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert cached_pages(path) == 0
    reader = DirectReader(str(path), direct=direct)
    try:
        assert reader.is_direct == direct
        assert reader.read_at(aligned_buffer(size), size, 0) == size
    finally:
        reader.close()
    assert (cached_pages(path) == 0) == direct


@pytest.mark.usefixtures("no_direct_open")
def test_a_filesystem_that_refuses_o_direct_gets_buffered_reads(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = _file_of(path, 3 * ALIGN, 6)
    reader = DirectReader(str(path))
    try:
        assert not reader.is_direct
        buf = aligned_buffer(3 * ALIGN)
        assert reader.read_at(buf, 3 * ALIGN, 0) == 3 * ALIGN
        assert buf.tobytes() == data
    finally:
        reader.close()


def _direct_reader(path: Path) -> DirectReader:
    """A DirectReader of ``path`` that reads with O_DIRECT; the test is skipped where it cannot."""
    reader = DirectReader(str(path))
    if not reader.is_direct:
        reader.close()
        pytest.skip("this filesystem refuses O_DIRECT at open")
    return reader


def test_a_direct_read_refused_after_the_open_falls_back_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems take the O_DIRECT open and refuse the read (EINVAL)."""
    path = tmp_path / "f"
    data = _file_of(path, 3 * ALIGN, 7)
    calls = []

    def refusing(self: DirectReader, buf: np.ndarray, offset: int) -> int:
        calls.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(DirectReader, "_read_direct", refusing)
    reader = _direct_reader(path)
    try:
        buf = aligned_buffer(3 * ALIGN)
        assert reader.read_at(buf, 2 * ALIGN, 0) == 2 * ALIGN
        assert not reader.is_direct and reader.refused
        assert reader.read_at(buf, ALIGN, 2 * ALIGN) == ALIGN
        assert calls == [0]  # tried once, then buffered
        assert buf[:ALIGN].tobytes() == data[2 * ALIGN :]
    finally:
        reader.close()


def test_a_direct_read_cut_short_before_the_end_is_finished_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS and FUSE may answer an O_DIRECT read with fewer bytes than asked mid-file."""
    path = tmp_path / "f"
    data = _file_of(path, 8 * ALIGN, 8)
    real = DirectReader._read_direct

    def short(self: DirectReader, buf: np.ndarray, offset: int) -> int:
        return min(real(self, buf, offset), 1000)  # as if only 1000 bytes had come

    monkeypatch.setattr(DirectReader, "_read_direct", short)
    reader = _direct_reader(path)
    try:
        buf = aligned_buffer(4 * ALIGN)
        assert reader.read_at(buf, 4 * ALIGN, 2 * ALIGN) == 4 * ALIGN
        assert buf.tobytes() == data[2 * ALIGN : 6 * ALIGN]
        assert reader.is_direct  # still direct for the next read
    finally:
        reader.close()


def test_huge_pages_that_come_slowly_give_way_to_small_pages_for_the_rest() -> None:
    """A kernel compacting memory for each huge page (15 ms a fault where the page cache has cut
    memory up) must not hold a run's start for seconds: past the budget, the rest of the buffer
    is advised to small pages and faulted in as such; within it, nothing is advised."""
    buf = np.ones(5 * HUGE_PAGE, dtype=np.uint8)
    advised: list[tuple[int, int]] = []
    ticks = iter([0.0, 0.001, 0.002, 1.0, 2.0, 3.0])  # the third huge page comes slowly
    assert not populate_pages(buf, lambda at, n: advised.append((at, n)), clock=lambda: next(ticks), budget=0.5)
    assert advised == [(3 * HUGE_PAGE, 2 * HUGE_PAGE)]
    assert not buf[:: mmap.PAGESIZE].any()  # every page touched, the first huge pages' too

    quick = iter(float(i) / 1000 for i in range(10))
    advised.clear()
    assert populate_pages(np.ones(3 * HUGE_PAGE, dtype=np.uint8), lambda at, n: advised.append((at, n)),
                          clock=lambda: next(quick), budget=0.5)  # fmt: skip
    assert advised == []


def test_a_populated_buffer_is_zeroed_and_writable_whatever_pages_it_got() -> None:
    buf = aligned_buffer(8 * HUGE_PAGE, populate=True)
    assert len(buf) == 8 * HUGE_PAGE and buf.ctypes.data % HUGE_PAGE == 0 and not buf.any()
    buf[:] = 7
    assert int(buf[-1]) == 7
