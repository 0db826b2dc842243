"""Fan every downloaded byte out to every rank, chunk by chunk, in the schedule's order.

The owner of a chunk reads it from its temporary file into a page-aligned buffer that is
allocated once, broadcasts it, and every other rank writes it at its offset. The buffer
goes to MPI whole (sliced into calls of at most 1 GiB); nothing is copied in Python.

Errors never leave a rank behind in a collective: a rank that fails keeps taking part
(without touching the disk) until the next check, where all ranks stop together.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from azcp_cluster.cluster import PeerFailed
from azcp_cluster.directio import DirectFile, aligned_buffer
from azcp_cluster.errors import AzcpError, BroadcastError
from azcp_cluster.localfs import fs_error, temp_path
from azcp_cluster.model import FileEntry
from azcp_cluster.schedule import Chunk, call_slices

# Ranks compare error flags this often (in chunks): rare enough to cost nothing, often
# enough that a failure stops the stage within a few chunks.
CHECK_EVERY = 16


@dataclass
class BroadcastStats:
    """What one rank's broadcast did."""

    sent_bytes: int = 0
    received_bytes: int = 0
    chunks: int = 0


class Broadcaster:
    """Walks a schedule: read (owner), broadcast (all), write (receivers)."""

    def __init__(
        self,
        comm: Any,
        files: Sequence[FileEntry],
        dest: str,
        chunk_size: int,
        *,
        on_bytes: Callable[[int], None] = lambda n: None,
        direct: bool = True,
    ) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.files = files
        self.dest = dest
        self.buffer = aligned_buffer(chunk_size)
        self.direct = direct
        self._reader, self._reader_file = -1, -1
        self._writer: DirectFile | None = None
        self._writer_file = -1
        self.on_bytes = on_bytes
        self.stats = BroadcastStats()

    def run(self, schedule: Sequence[Chunk]) -> BroadcastStats:
        """Broadcast every chunk; raise the first local error after all ranks have stopped."""
        from mpi4py import MPI

        error: AzcpError | None = None
        try:
            for chunk in schedule:
                view = self.buffer[: chunk.length]
                is_root = chunk.root == self.rank
                if error is None and is_root:
                    try:
                        self._read(view, chunk)
                    except AzcpError as exc:
                        error = exc
                for start, stop in call_slices(chunk.length):
                    self.comm.Bcast([view[start:stop], MPI.BYTE], root=chunk.root)
                if error is None:
                    try:
                        if is_root:
                            self.stats.sent_bytes += chunk.length
                        else:
                            self._write(view, chunk)
                            self.stats.received_bytes += chunk.length
                    except AzcpError as exc:
                        error = exc
                self.stats.chunks += 1
                self.on_bytes(chunk.length)
                if chunk.last_of_file:
                    self._close()
                if (chunk.seq + 1) % CHECK_EVERY == 0 and self.comm.allreduce(0 if error is None else 1) > 0:
                    if error is None:
                        raise PeerFailed()
                    break
        finally:
            self._close()
        if error is not None:
            raise error
        return self.stats

    def _path(self, chunk: Chunk) -> str:
        return temp_path(self.dest, self.files[chunk.file].path)

    def _read(self, view: np.ndarray, chunk: Chunk) -> None:
        path = self._path(chunk)
        try:
            if self._reader_file != chunk.file:
                self._close()
                self._reader = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self._reader_file = chunk.file
            got = os.preadv(self._reader, [memoryview(view)], chunk.offset)  # type: ignore[arg-type]
        except OSError as exc:
            raise fs_error(exc, path, "read back") from None
        if got != chunk.length:
            raise BroadcastError(f"short read of own download ({got} of {chunk.length} bytes)", path=path)

    def _write(self, view: np.ndarray, chunk: Chunk) -> None:
        path = self._path(chunk)
        try:
            if self._writer is None or self._writer_file != chunk.file:
                self._close()
                self._writer = DirectFile(path, direct=self.direct)
                self._writer_file = chunk.file
            self._writer.write_at(view, chunk.offset)
        except OSError as exc:
            raise fs_error(exc, path, "write") from None

    def _close(self) -> None:
        if self._reader >= 0:
            os.close(self._reader)
        if self._writer is not None:
            self._writer.close()
        self._reader, self._reader_file = -1, -1
        self._writer, self._writer_file = None, -1
