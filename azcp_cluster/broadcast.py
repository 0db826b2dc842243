"""Fan every downloaded byte out to every rank, chunk by chunk, in the schedule's order.

The owner of a chunk reads it from its temporary file into a page-aligned buffer that is
allocated once, broadcasts it, and every other rank writes it at its offset. The buffer
goes to MPI whole (sliced into calls of at most 1 GiB); nothing is copied in Python.

Errors never leave a rank behind in a collective: a rank that fails keeps taking part
(without touching the disk) until the next check, where all ranks stop together.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from azcp_cluster.cluster import PeerFailed
from azcp_cluster.errors import AzcpError, BroadcastError
from azcp_cluster.localfs import fs_error, open_temp, pwritev_all, temp_path
from azcp_cluster.model import FileEntry
from azcp_cluster.schedule import Chunk, call_slices

# Ranks compare error flags this often (in chunks): rare enough to cost nothing, often
# enough that a failure stops the stage within a few chunks.
CHECK_EVERY = 16


def aligned_buffer(size: int) -> np.ndarray:
    """A page-aligned, zero-copy byte buffer (anonymous mmap), usable with O_DIRECT."""
    region = mmap.mmap(-1, max(size, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8, count=size)


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
    ) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.files = files
        self.dest = dest
        self.buffer = aligned_buffer(chunk_size)
        self.on_bytes = on_bytes
        self.stats = BroadcastStats()

    def run(self, schedule: Sequence[Chunk]) -> BroadcastStats:
        """Broadcast every chunk; raise the first local error after all ranks have stopped."""
        from mpi4py import MPI

        error: AzcpError | None = None
        fd = -1
        fd_file = -1
        try:
            for chunk in schedule:
                view = self.buffer[: chunk.length]
                is_root = chunk.root == self.rank
                if error is None:
                    try:
                        if fd_file != chunk.file:
                            if fd >= 0:
                                os.close(fd)
                                fd = -1
                            fd = open_temp(self.dest, self.files[chunk.file].path)
                            fd_file = chunk.file
                        if is_root:
                            self._read(fd, view, chunk)
                    except AzcpError as exc:
                        error = exc
                for start, stop in call_slices(chunk.length):
                    self.comm.Bcast([view[start:stop], MPI.BYTE], root=chunk.root)
                if error is None:
                    try:
                        if is_root:
                            self.stats.sent_bytes += chunk.length
                        else:
                            self._write(fd, view, chunk)
                            self.stats.received_bytes += chunk.length
                    except AzcpError as exc:
                        error = exc
                self.stats.chunks += 1
                self.on_bytes(chunk.length)
                if chunk.last_of_file and fd >= 0:
                    os.close(fd)
                    fd, fd_file = -1, -1
                if (chunk.seq + 1) % CHECK_EVERY == 0 and self.comm.allreduce(0 if error is None else 1) > 0:
                    if error is None:
                        raise PeerFailed()
                    break
        finally:
            if fd >= 0:
                os.close(fd)
        if error is not None:
            raise error
        return self.stats

    def _read(self, fd: int, view: np.ndarray, chunk: Chunk) -> None:
        path = temp_path(self.dest, self.files[chunk.file].path)
        try:
            got = os.preadv(fd, [memoryview(view)], chunk.offset)  # type: ignore[arg-type]
        except OSError as exc:
            raise fs_error(exc, path, "read back") from None
        if got != chunk.length:
            raise BroadcastError(f"short read of own download ({got} of {chunk.length} bytes)", path=path)

    def _write(self, fd: int, view: np.ndarray, chunk: Chunk) -> None:
        try:
            pwritev_all(fd, [memoryview(view)], chunk.offset)  # type: ignore[arg-type]
        except OSError as exc:
            raise fs_error(exc, temp_path(self.dest, self.files[chunk.file].path), "write") from None
