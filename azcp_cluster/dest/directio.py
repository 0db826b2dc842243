"""Page-aligned buffers, and writes and reads that bypass the page cache where the filesystem allows.

O_DIRECT needs the buffer address, the file offset and the length to be multiples of the
alignment. :class:`DirectFile` writes the aligned part of every write with O_DIRECT and
the rest (a file's unaligned tail) through an ordinary descriptor, so callers never have
to think about it; where O_DIRECT is refused (some filesystems) it writes everything
through the ordinary descriptor. :class:`DirectReader` does the same for reads (reading
a file's last block whole, into room the buffer has for it). Large buffers are made of
transparent huge pages where the kernel gives them (see :func:`aligned_buffer`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from azcp_cluster.core.plan import round_up
from azcp_cluster.dest.localfs import preadv_all, pwritev_all

# Opens a file with the flags given and returns the descriptor (see desttree.DestTree.opener).
Opener = Callable[[int], int]

ALIGN = 4096
# The x86-64 and arm64 (4 KiB base pages) size of a transparent huge page.
HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
_MADV_NOHUGEPAGE: int = getattr(mmap, "MADV_NOHUGEPAGE", 15)
# Seconds a buffer's huge pages may take to fault in before the rest takes small pages
# (populate_pages): 30 times what 144 MiB of them take where the kernel has them at hand.
HUGE_PAGE_BUDGET = 0.05


def aligned_buffer(size: int, populate: bool = False) -> np.ndarray:
    """A page-aligned, zero-filled byte buffer (anonymous mmap), usable for O_DIRECT I/O.

    A buffer of at least :data:`HUGE_PAGE` is aligned to it and asks for transparent huge
    pages (``MADV_HUGEPAGE``; the kernel's default setting, ``madvise``, gives them only to
    regions that ask). An O_DIRECT write from 4 KiB pages pins and hands the device one
    segment per page; from huge pages, one per 2 MiB: raw 2 MiB O_DIRECT writes went from
    about 970 to about 1560 MiB/s here, at half the CPU. Where the kernel has none, the
    buffer is made of ordinary pages, as before.

    ``populate`` maps every page now instead of at first touch: 256 MiB of small pages costs
    about 0.15 s of page faults here, better paid at start-up than in the middle of a stage.
    """
    if size < HUGE_PAGE or _MADV_HUGEPAGE is None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if populate:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        region = mmap.mmap(-1, max(size, mmap.PAGESIZE), flags=flags)
        return np.frombuffer(region, dtype=np.uint8, count=size)
    # One huge page more than needed, so that an aligned start lies inside; the part not
    # used is never touched and takes no memory.
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel built without transparent huge pages: small pages
        region.madvise(_MADV_HUGEPAGE, start, size)
    buf = whole[start : start + size]
    if populate:
        # Not MAP_POPULATE: that would fault the pages in before the advice, as small pages.
        populate_pages(buf, lambda at, length: region.madvise(_MADV_NOHUGEPAGE, start + at, length))
    return buf


def populate_pages(
    buf: np.ndarray,
    small_pages: Callable[[int, int], None],
    clock: Callable[[], float] = time.perf_counter,
    budget: float = HUGE_PAGE_BUDGET,
) -> bool:
    """Fault every page of ``buf`` (advised for huge pages) in now, one huge page at a time;
    once that has taken ``budget`` seconds, the kernel is compacting memory to find each huge
    page, and the rest is advised to small pages (``small_pages(offset, length)``) and faulted
    in as such. Returns whether every page was faulted in as asked (no switch).

    A huge page's fault zeroes 2 MiB in about 0.25 ms here; on a machine whose memory the page
    cache has cut up (``compact_stall`` in /proc/vmstat), each took 15 ms: a pool of 72 of them
    held up a run's start by 1.1 to 1.9 s, where small pages take 0.06 s for all of it.
    """
    began = clock()
    for at in range(0, len(buf), HUGE_PAGE):
        buf[at : at + HUGE_PAGE : mmap.PAGESIZE] = 0  # one write per page faults each in
        rest = at + HUGE_PAGE
        if rest < len(buf) and clock() - began > budget:
            with contextlib.suppress(OSError):
                small_pages(rest, len(buf) - rest)
            buf[rest :: mmap.PAGESIZE] = 0
            return False
    return True


def aligned_buffers(size: int, count: int, populate: bool = False) -> list[np.ndarray]:
    """``count`` page-aligned buffers of ``size`` bytes, cut from one :func:`aligned_buffer`.

    One mapping for a pool: it asks for huge pages as a whole (buffers smaller than a huge
    page share them) and carries one huge page of alignment slack for all, not one each.
    The mapping lives as long as any of the buffers.
    """
    stride = round_up(size, ALIGN)
    whole = aligned_buffer(stride * count, populate)
    return [whole[i * stride : i * stride + size] for i in range(count)]


def align_down(value: int, align: int = ALIGN) -> int:
    """Largest multiple of ``align`` that is <= ``value``."""
    return value - value % align


class _Descriptors:
    """A file opened twice: an ordinary descriptor, and an O_DIRECT one where possible.

    ``opener`` opens the file with the flags it is given (``desttree.DestTree.opener`` for
    names below DEST: no link followed, regular files only); both descriptors must reach
    the same file, or the file was swapped between the two opens and is refused.
    """

    def __init__(self, path: str, mode: int, direct: bool, opener: Opener | None = None) -> None:
        self.path = path
        open_with: Opener = opener if opener is not None else (lambda flags: os.open(path, flags | os.O_CLOEXEC))
        self.fd = open_with(mode)
        self.direct_fd = -1
        # The filesystem refused O_DIRECT, at the open or at the first I/O: the caller may
        # warn once. A descriptor refused later stays open until close(): other threads may
        # be using it at the same moment.
        self.refused = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = open_with(mode | os.O_DIRECT)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    os.close(self.fd)
                    raise
                self.refused = True
            except BaseException:
                os.close(self.fd)
                raise
            else:
                first, second = os.fstat(self.fd), os.fstat(self.direct_fd)
                if (first.st_dev, first.st_ino) != (second.st_dev, second.st_ino):
                    self.close()
                    raise OSError(errno.ESTALE, "the file was replaced while it was opened")

    @property
    def is_direct(self) -> bool:
        """Whether aligned I/O bypasses the page cache."""
        return self.direct_fd >= 0 and not self.refused

    def close(self) -> None:
        """Close both descriptors (no fsync: the finalize step does that once per file)."""
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DirectFile(_Descriptors):
    """An existing file opened for positional writes, O_DIRECT where possible."""

    def __init__(self, path: str, direct: bool = True, opener: Opener | None = None) -> None:
        super().__init__(path, os.O_WRONLY, direct, opener)

    def write_at(self, data: np.ndarray, offset: int) -> int:
        """Write all of ``data`` (a 1-D uint8 array, page-aligned for O_DIRECT) at ``offset``."""
        return self.write_many([data], offset)

    def write_many(self, parts: list[np.ndarray], offset: int) -> int:
        """Write ``parts`` back to back from ``offset`` with as few system calls as possible.

        With O_DIRECT, every part but the last must be a whole number of alignment blocks
        and start on an aligned address (pool buffers are); the unaligned tail of the last
        part goes through the ordinary descriptor.
        """
        length = sum(int(p.shape[0]) for p in parts)
        done = 0
        if self.is_direct and offset % ALIGN == 0 and self._direct_ok(parts):
            aligned = align_down(length)
            head = list(parts[:-1])
            last = parts[-1][: aligned - (length - int(parts[-1].shape[0]))]
            if last.shape[0]:
                head.append(last)
            if aligned:
                try:
                    done = pwritev_all(self.direct_fd, [memoryview(p) for p in head], offset)  # type: ignore[arg-type]
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # The filesystem took the open but refuses the write: go buffered for good.
                    self.refused = True
                    done = 0
        if done < length:
            rest = _skip(parts, done)
            done += pwritev_all(self.fd, [memoryview(p) for p in rest], offset + done)  # type: ignore[arg-type]
        return done

    @staticmethod
    def _direct_ok(parts: list[np.ndarray]) -> bool:
        if any(p.ctypes.data % ALIGN for p in parts):
            return False
        return all(int(p.shape[0]) % ALIGN == 0 for p in parts[:-1])


class DirectReader(_Descriptors):
    """An existing file opened for positional reads, O_DIRECT where possible.

    For data known not to be in the page cache (what this run wrote with O_DIRECT): a
    buffered read copies it through the cache, in the kernel's read-ahead sizes, and
    leaves it there. Read back this way by their owners, the benchmark's broadcast of
    512 MiB on 2 ranks went from about 630 to about 850 MiB/s per receiver.
    """

    def __init__(self, path: str, direct: bool = True, opener: Opener | None = None) -> None:
        super().__init__(path, os.O_RDONLY, direct, opener)

    def read_at(self, buf: np.ndarray, length: int, offset: int) -> int:
        """Read ``length`` bytes at ``offset`` into the start of ``buf``; fewer only at end of file.

        O_DIRECT reads whole alignment blocks: when ``offset`` and ``buf`` are aligned and
        ``buf`` has room for ``length`` rounded up, it reads that much (what lies past
        ``length`` is left in ``buf`` and not counted); otherwise the ordinary descriptor.
        """
        span = round_up(length, ALIGN)
        if self.is_direct and offset % ALIGN == 0 and buf.ctypes.data % ALIGN == 0 and span <= len(buf):
            try:
                got = min(length, self._read_direct(buf[:span], offset))
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.refused = True  # the filesystem took the open but refuses the read
            else:
                if got < length:
                    # Short before the end of the file (NFS and FUSE may answer so), or at
                    # the end: the rest through the cache, which reads nothing at the end.
                    got += preadv_all(self.fd, buf[got:length], offset + got)
                return got
        return preadv_all(self.fd, buf[:length], offset)

    def _read_direct(self, buf: np.ndarray, offset: int) -> int:
        # A short read off a block boundary ends it: a further O_DIRECT read from there
        # would be refused (read_at reads any rest through the cache).
        return preadv_all(self.direct_fd, buf, offset, block=ALIGN)


def _skip(parts: list[np.ndarray], count: int) -> list[np.ndarray]:
    """``parts`` without their first ``count`` bytes."""
    rest = []
    for part in parts:
        size = int(part.shape[0])
        if count >= size:
            count -= size
            continue
        rest.append(part[count:])
        count = 0
    return rest
