"""A completed slot's extents written to their files: the fan-out's writer threads' work.

O_DIRECT where the extent allows it (``schedule.Extent.direct``); a run of small extents in one
directory walks to it once; a small file this node only receives is created on its arrival,
one open. Every written range goes to ``on_written`` (the block journal).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from azcp_cluster.core.fanout import Write
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.schedule import Extent
from azcp_cluster.dest.destroot import split
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectFile
from azcp_cluster.dest.localfs import fs_error, pwritev_all
from azcp_cluster.fanout.events import BroadcastStats


class SlotWriter:
    """Writes the extents of completed slots into this node's temporary files."""

    def __init__(
        self,
        files: Sequence[FileEntry],
        tree: DestTree,
        direct: bool,
        made_on_arrival: set[int],
        stats: BroadcastStats,
        on_written: Callable[[int, int, int], None],
    ) -> None:
        self.files = files
        self.tree = tree
        self.direct = direct
        self.made_on_arrival = made_on_arrival
        self.stats = stats  # direct_refused is set on it
        self.on_written = on_written

    def work(self, job: Write, buffer: Any) -> Callable[[], None]:
        """The disk writer's work for one Write: its extents, from the slot to their files."""

        def write_extent(extent: Extent, buffer: Any, dfd: int | None) -> None:
            rel = self.files[extent.file].path
            shown = self.tree.temp_shown(rel)
            if dfd is not None and extent.file in self.made_on_arrival:
                fd = self.tree.create_at(dfd, rel)
                try:
                    pwritev_all(fd, [memoryview(buffer[extent.at : extent.at + extent.length])], extent.offset)
                except OSError as exc:
                    raise fs_error(exc, shown, "write") from None
                finally:
                    os.close(fd)
                return
            try:
                target = DirectFile(
                    shown, direct=self.direct and extent.direct, opener=self.tree.opener(rel, temp=True, dfd=dfd)
                )
                try:
                    target.write_at(buffer[extent.at : extent.at + extent.length], extent.offset)
                finally:
                    if target.refused:
                        self.stats.direct_refused = target.path
                    target.close()
            except OSError as exc:
                raise fs_error(exc, shown, "write") from None

        def write() -> None:
            # Small files packed in one slot lie mostly in a few directories: each run of
            # extents in one directory walks to it once (a large extent walks on its own).
            for folder, extents in self.by_directory(job.extents):
                if folder is None:
                    write_extent(extents[0], buffer, None)
                    self.on_written(extents[0].file, extents[0].offset, extents[0].length)
                    continue
                try:
                    with self.tree.directory(folder) as dfd:
                        for extent in extents:
                            write_extent(extent, buffer, dfd)
                            self.on_written(extent.file, extent.offset, extent.length)
                except OSError as exc:
                    raise fs_error(exc, self.tree.shown("/".join(folder)), "write") from None

        return write

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
