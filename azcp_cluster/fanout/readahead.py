"""The root's side of a fan-out slot: fill it with a transfer's extents before it is posted.

From the node's download of this run (written with O_DIRECT, so read back with O_DIRECT
too: none of it is cached; streaming, copied from the download's buffers while they still
hold it, see :class:`azcp_cluster.fanout.events.HeldBlocks`), a complete copy this rank already
had, or a local SOURCE (both read through the page cache, with a read-ahead hint for the
next transfer). A local
SOURCE's file that changed since it was listed, or while it was read, is noted in
``changed`` (its copies are torn: the pipeline reads it again or fails), not raised.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

import numpy as np

from azcp_cluster.core.crc import crc32
from azcp_cluster.core.errors import BroadcastError, SourceError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.schedule import Extent, Transfer
from azcp_cluster.dest.desttree import DestTree, source_opener
from azcp_cluster.dest.directio import DirectReader, Opener
from azcp_cluster.dest.localfs import fs_error
from azcp_cluster.dest.localsource import as_listed
from azcp_cluster.fanout.events import HeldBlocks


class ReadAhead:
    """Reads one rank's transfers into their slots, one file held open across its extents.

    Used by one thread at a time (the fan-out's read-ahead thread); :meth:`close` when done.
    """

    def __init__(
        self,
        files: Sequence[FileEntry],
        tree: DestTree,
        schedule: Sequence[Transfer],
        rank: int,
        *,
        have: Sequence[bool],
        source_of: Callable[[int], str | None],
        direct: bool,
        hint_window: int,
        changed: set[int],
        held: HeldBlocks | None = None,
        source_pieces: Callable[[int, int, int, int], None] | None = None,
    ) -> None:
        self.files = files
        self.tree = tree
        self.schedule = schedule
        self.rank = rank
        self.have = have
        self.source_of = source_of
        self.direct = direct
        self.hint_window = hint_window  # how many transfers ahead the next one of ours is looked for
        self.changed = changed
        self.source_bytes = 0  # bytes read from a local SOURCE
        self.held = held  # streaming: this rank's download's buffers, still holding what it landed
        self.memory_bytes = 0  # bytes copied from them
        # --verify: told each extent read whole from a local SOURCE, with the CRC-32 of its bytes
        # as read (the source's side of the check of every copy: core/crc.py).
        self.source_pieces = source_pieces
        # The file open across its extents: (reader, file index, its stat when opened).
        self._current: tuple[DirectReader, int, os.stat_result] | None = None

    def read(self, transfer: Transfer, buffer: np.ndarray) -> None:
        """Fill ``buffer`` with ``transfer``'s extents; raise what makes the slot unusable."""
        for extent in transfer.extents:
            self._read_extent(extent, buffer)
        # The hint names the file still open, which is the transfer's last only if that was
        # read from the disk (not copied from memory).
        current = self._current
        last = transfer.extents[-1].file
        self._advise_next(transfer, current[0].fd if current is not None and current[1] == last else -1)

    def close(self) -> None:
        """Close the file still open, if any."""
        if self._current is not None:
            current, self._current = self._current, None
            current[0].close()

    def _open(self, extent: Extent, shown: str, opener: Opener, outside: bool) -> tuple[DirectReader, os.stat_result]:
        """The reader of ``extent``'s file: the one open, or the file opened now."""
        if self._current is not None and self._current[1] != extent.file:
            self.close()
        if self._current is None:
            direct = self.direct and self._downloaded(extent.file) and extent.direct
            reader = DirectReader(shown, direct=direct, opener=opener)
            self._current = (reader, extent.file, os.fstat(reader.fd))
            if outside and not self._as_listed(extent.file, self._current[2]):
                self.changed.add(extent.file)  # changed since it was listed
        return self._current[0], self._current[2]

    def _read_extent(self, extent: Extent, buffer: np.ndarray) -> None:
        into = buffer[extent.at : extent.at + extent.length]
        held = self.held if self._downloaded(extent.file) else None
        if held is not None and held.copy_held(extent.file, extent.offset, into):
            self.memory_bytes += extent.length
            if extent.last_of_file and self._current is not None and self._current[1] == extent.file:
                self.close()  # its earlier extents came from the disk: nothing more is read of it
            return
        shown, opener = self._source(extent.file)
        outside = self.source_of(extent.file) is not None
        try:
            reader, opened = self._open(extent, shown, opener, outside)
            got = reader.read_at(buffer[extent.at :], extent.length, extent.offset)
            if outside:
                self.source_bytes += got
            if outside and extent.last_of_file and not _same_version(opened, os.fstat(reader.fd)):
                self.changed.add(extent.file)  # written to while it was read
        except OSError as exc:
            if outside:
                raise SourceError(f"cannot read the file: {exc.strerror or exc}", path=shown) from None
            raise fs_error(exc, shown, "read back") from None
        if got != extent.length:
            if outside:
                self.changed.add(extent.file)  # shorter than listed: truncated meanwhile
                return
            raise BroadcastError(f"short read ({got} of {extent.length} bytes)", path=shown)
        if outside and self.source_pieces is not None:
            self.source_pieces(extent.file, extent.offset, extent.length, crc32(memoryview(into)))  # type: ignore[arg-type]
        if extent.last_of_file:
            self.close()  # a small file's descriptor is not kept to the next

    def _downloaded(self, index: int) -> bool:
        """Whether the root reads file ``index`` from its own download of this run.

        Those were written with O_DIRECT, so none of it is cached: read back with O_DIRECT
        too. A local SOURCE or a copy from an earlier run may well be cached: read through
        the cache, with the read-ahead hint.
        """
        return self.source_of(index) is None and not self.have[index]

    def _advise_next(self, transfer: Transfer, fd: int) -> None:
        """Ask the kernel to start reading this rank's next transfer while the calls run.

        Only where it costs no open: the next transfer continues the file still open (a
        large file read through the page cache: a local SOURCE, a copy this rank already
        had). A range that will be read with O_DIRECT gets none: the hint would read it a
        second time, into the cache.
        """
        if fd < 0:
            return
        last = transfer.extents[-1]
        for later in self.schedule[transfer.seq + 1 : transfer.seq + 1 + self.hint_window]:
            if later.root != self.rank:
                continue
            first = later.extents[0]
            if first.file == last.file and not (self.direct and self._downloaded(first.file) and first.direct):
                with contextlib.suppress(OSError):  # only a hint
                    os.posix_fadvise(fd, first.offset, first.length, os.POSIX_FADV_WILLNEED)
            return

    def _source(self, index: int) -> tuple[str, Opener]:
        """Where the root reads a file (for messages, and its opener): the local SOURCE, its
        complete copy, or its download."""
        outside = self.source_of(index)
        if outside is not None:
            return outside, source_opener(outside)
        rel = self.files[index].path
        if self.have[index]:
            return self.tree.shown(rel), self.tree.opener(rel, temp=False)
        return self.tree.temp_shown(rel), self.tree.opener(rel, temp=True)

    def _as_listed(self, index: int, st: os.stat_result) -> bool:
        """Whether a local SOURCE file opened now is the version that was listed."""
        entry = self.files[index]
        return st.st_size == entry.size and as_listed(st, entry.etag)


def _same_version(before: os.stat_result, after: os.stat_result) -> bool:
    """Whether a file was left alone between two stats (size, mtime and ctime: a write moves
    mtime, and a write that sets mtime back still moves ctime)."""
    return (before.st_size, before.st_mtime_ns, before.st_ctime_ns) == (
        after.st_size,
        after.st_mtime_ns,
        after.st_ctime_ns,
    )


__all__ = ["ReadAhead"]
