"""The node's one writer into DEST's temporary files, for the download and the fan-out alike.

:class:`NodeWriter` alone opens the temporary files, creates on arrival the small ones
whose names were deferred (``DestTree.prepare_all``'s ``later``), walks once to the
directory of a run of small extents, writes with O_DIRECT where the alignment allows it
(:class:`~azcp_cluster.dest.directio.DirectFile`) and records the ranges it writes for the
fan-out in the block journal. Its writes run on one set of threads
(:class:`~azcp_cluster.dest.diskwriter.DiskWriter`).

Two shapes of work come to it. The download opens a block's file once (:meth:`NodeWriter.open`)
and queues each full pool buffer of the block (:meth:`NodeWriter.write`); the block is
journaled once all its writes are done, by the download's landing sink (``download.fetcher``:
a worker process's blocks can only be recorded by its rank, which hears of them there). The
fan-out queues a slot's extents at once (:meth:`NodeWriter.write_extents`), each recorded in
the journal as it is written. The bytes are written from the callers' buffers (``pwritev``),
never copied.

Whoever makes a NodeWriter closes it (the run's stages, see ``stages.context``): nothing
that merely uses one does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from types import TracebackType

import numpy as np

from azcp_cluster.core.crc import crc32
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.schedule import Extent
from azcp_cluster.dest.destroot import split
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectFile
from azcp_cluster.dest.diskwriter import DiskWriter
from azcp_cluster.dest.localfs import fs_error, pwritev_all

# (file, offset, length, CRC-32 of the bytes) once written (not yet durable): what the block journal is fed.
Record = Callable[[int, int, int, int, bool], None]
# A write's end, on the writer thread: the exception it raised, or None.
Done = Callable[[BaseException | None], None]


class NodeWriter:
    """Writes extents of the listing's files into this node's temporary files, on ``threads`` threads.

    ``files``: the listing (or the part of it a download worker writes), by index.
    ``on_arrival``: the files whose temporary name the writer creates when their bytes come
    (small, packed, never O_DIRECT). ``journal``: told every range once written.
    """

    def __init__(
        self,
        files: Sequence[FileEntry] | Mapping[int, FileEntry],
        tree: DestTree,
        threads: int,
        *,
        on_arrival: Collection[int] = frozenset(),
        journal: Record | None = None,
        name: str = "azcp-writer",
    ) -> None:
        self.files = files
        self.tree = tree
        self.on_arrival = on_arrival
        self.journal = journal
        self._threads = DiskWriter(threads, name=name)

    def __enter__(self) -> NodeWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    @property
    def size(self) -> int:
        """The number of writer threads (0 once closed)."""
        return self._threads.size

    def close(self) -> None:
        """Stop the threads once the queued writes are done (idempotent)."""
        self._threads.close()

    def written(self, extent: Extent, buffer: np.ndarray, source: bool) -> None:
        """Record in the journal that ``extent`` was written from ``buffer``, with the CRC-32 of
        its bytes as they arrived (a rerun reads them back and keeps them only if it still holds);
        ``source``: read from the source itself (a local SOURCE's reader), not received."""
        if self.journal is not None:
            data = memoryview(buffer[extent.at : extent.at + extent.length])  # type: ignore[arg-type]
            self.journal(extent.file, extent.offset, extent.length, crc32(data), source)

    # -- the download: one file open for a block's writes ------------------------------

    def open(self, file: int) -> DirectFile:
        """``file``'s temporary file opened for a block's writes (O_DIRECT where possible);
        the caller closes it once its writes are done."""
        rel = self.files[file].path
        shown = self.tree.temp_shown(rel)
        try:
            return DirectFile(shown, opener=self.tree.opener(rel, temp=True))
        except OSError as exc:
            raise fs_error(exc, shown, "open temporary file") from None

    def write(self, target: DirectFile, data: np.ndarray, offset: int, done: Done) -> None:
        """Queue ``data`` (a pool buffer, page-aligned) for writing at ``offset`` of ``target``.

        ``done(error)`` runs on the writer thread once it is written (the raw OSError, if
        any: the caller names the file). A closed writer raises here, and ``done`` is not called.
        """
        self._threads.submit(lambda: target.write_at(data, offset), done)

    # -- the fan-out: a slot's extents ---------------------------------------------------

    def write_extents(
        self,
        extents: Sequence[Extent],
        buffer: np.ndarray,
        direct: bool,
        done: Done,
        refused: Callable[[str], None],
        source: bool = False,
    ) -> None:
        """Queue the writes of ``extents``, each from ``buffer[extent.at:]``; ``done(error)`` after
        the last (an error names the file). O_DIRECT where ``direct`` and the extent allow it;
        ``refused(path)`` when a filesystem refuses it. ``source``: the buffer was read from the
        source itself (a local SOURCE's reader writing its own copy), not received (the journal)."""
        self._threads.submit(lambda: self._write_extents(extents, buffer, direct, refused, source), done)

    def _write_extents(
        self, extents: Sequence[Extent], buffer: np.ndarray, direct: bool, refused: Callable[[str], None], source: bool
    ) -> None:
        # Small files packed in one slot lie mostly in a few directories: each run of
        # extents in one directory walks to it once (a large extent walks on its own).
        for folder, run in self.by_directory(extents):
            if folder is None:
                self._write_extent(run[0], buffer, None, direct, refused)
                self.written(run[0], buffer, source)
                continue
            try:
                with self.tree.directory(folder) as dfd:
                    for extent in run:
                        self._write_extent(extent, buffer, dfd, direct, refused)
                        self.written(extent, buffer, source)
            except OSError as exc:
                raise fs_error(exc, self.tree.shown("/".join(folder)), "write") from None

    def _write_extent(
        self, extent: Extent, buffer: np.ndarray, dfd: int | None, direct: bool, refused: Callable[[str], None]
    ) -> None:
        """One extent into its file: created now if it is made on arrival, else opened (``dfd``:
        its directory, already walked to)."""
        rel = self.files[extent.file].path
        shown = self.tree.temp_shown(rel)
        data = buffer[extent.at : extent.at + extent.length]
        if dfd is not None and extent.file in self.on_arrival:
            fd = self.tree.create_at(dfd, rel)  # one open, no O_DIRECT: a small file
            try:
                pwritev_all(fd, [memoryview(data)], extent.offset)  # type: ignore[arg-type]
            except OSError as exc:
                raise fs_error(exc, shown, "write") from None
            finally:
                os.close(fd)
            return
        try:
            opener = self.tree.opener(rel, temp=True, dfd=dfd)
            target = DirectFile(shown, direct=direct and extent.direct, opener=opener)
            try:
                target.write_at(data, extent.offset)
            finally:
                if target.refused:
                    refused(target.path)
                target.close()
        except OSError as exc:
            raise fs_error(exc, shown, "write") from None

    def by_directory(self, extents: Sequence[Extent]) -> list[tuple[list[str] | None, list[Extent]]]:
        """Consecutive runs of small extents in one directory; a direct (large) extent alone, with None."""
        runs: list[tuple[list[str] | None, list[Extent]]] = []
        for extent in extents:
            if extent.direct:
                runs.append((None, [extent]))
                continue
            folder = split(self.files[extent.file].path)[0]
            if runs and runs[-1][0] == folder:
                runs[-1][1].append(extent)
            else:
                runs.append((folder, [extent]))
        return runs


__all__ = ["NodeWriter"]
