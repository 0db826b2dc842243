"""Fan every downloaded byte out to every rank: a pipeline of non-blocking broadcasts.

``pipeline`` slots of ``chunk_size`` bytes, page-aligned and allocated once, cycle through
the schedule (chunk ``j`` uses slot ``j % pipeline``), so up to ``pipeline`` ``MPI_Ibcast``
calls are in flight at once, across files and owners, in the order every rank derives
from the plan. Around the MPI calls, threads keep the disk off MPI's critical path:

* the owner of a chunk has it read into its slot by a read-ahead thread as soon as the
  slot is free, so the broadcast can start the moment its turn comes;
* receivers hand each completed slot to ``writers`` threads through a bounded queue; the
  threads write it with O_DIRECT (``directio.DirectFile``) and give the slot back.

Errors never leave a rank behind in a collective: a rank that fails keeps taking part
(without touching the disk) until the next check, where all ranks stop together.
"""

from __future__ import annotations

import base64
import hashlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from azcp_cluster.cluster import PeerFailed
from azcp_cluster.desttree import DestTree, source_opener
from azcp_cluster.directio import ALIGN, DirectFile, DirectReader, Opener, aligned_buffer
from azcp_cluster.errors import AzcpError, BroadcastError, InternalError, SourceError
from azcp_cluster.localfs import fs_error
from azcp_cluster.localsource import local_etag
from azcp_cluster.model import FileEntry
from azcp_cluster.plan import round_up
from azcp_cluster.schedule import Chunk, call_slices

# Ranks compare error flags this often (in chunks): rare enough to cost nothing, often
# enough that a failure stops the stage within a few chunks.
CHECK_EVERY = 16
# Seconds between tests of a broadcast in flight (see _wait).
POLL_NAP = 0.0002


@dataclass
class BroadcastStats:
    """What one rank's broadcast did."""

    sent_bytes: int = 0
    received_bytes: int = 0
    chunks: int = 0
    direct_refused: str = ""  # a path whose filesystem refused O_DIRECT, if any


class _Slot:
    """One pipeline buffer and the signal that it may be used for its next chunk."""

    def __init__(self, size: int) -> None:
        # Rounded up to whole blocks: an O_DIRECT read of a chunk with an unaligned end
        # (a file's last) reads the whole last block.
        self.buffer = aligned_buffer(round_up(size, ALIGN), populate=True)
        self.ready = threading.Event()
        self.users = 0  # threads (writer, hasher) still reading the chunk in it
        self.lock = threading.Lock()


class Broadcaster:
    """Walks a schedule: read ahead (owner), Ibcast (all), write behind (receivers)."""

    def __init__(
        self,
        comm: Any,
        files: Sequence[FileEntry],
        tree: DestTree,
        chunk_size: int,
        *,
        pipeline: int = 4,
        writers: int = 2,
        direct: bool = True,
        have: Sequence[bool] | None = None,
        verify: bool = False,
        on_bytes: Callable[[int], None] = lambda n: None,
        source_of: Callable[[int], str | None] | None = None,
        stop_requested: Callable[[], AzcpError | None] = lambda: None,
    ) -> None:
        if pipeline < 1 or writers < 1:
            raise ValueError("pipeline and writers must be at least 1")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.files = files
        self.tree = tree
        self.direct = direct
        # Files this rank already has under their final names: it sends them from there
        # (peers before Azure) and does not write them again.
        self.have = have if have is not None else [False] * len(files)
        # A local SOURCE's reader sends from the source itself, not from a downloaded
        # temporary file, so it writes its own copy of what it sends like a receiver.
        self.source_of = source_of if source_of is not None else (lambda index: None)
        self.on_bytes = on_bytes
        # Polled at every chunk (a SIGINT/SIGTERM this rank got): its error fails this rank
        # like a local one, so the next check stops every rank at the same chunk.
        self.stop_requested = stop_requested
        self.stats = BroadcastStats()
        self.slots = [_Slot(chunk_size) for _ in range(pipeline)]
        self.writer_count = writers
        self._error: AzcpError | None = None
        self._error_lock = threading.Lock()
        self._schedule: Sequence[Chunk] = ()
        # --verify: every rank sees every chunk in its slot, in file and offset order, so it
        # hashes whole files as they stream past (no second read of anything it wrote).
        self.verify = verify
        self.digests: dict[int, str] = {}
        # A local SOURCE's files that changed while they were read (or since they were
        # listed): their copies are torn, and the pipeline reads them again or fails.
        self.changed: set[int] = set()

    # -- the MPI side (main thread) -------------------------------------------------------

    def run(self, schedule: Sequence[Chunk]) -> BroadcastStats:
        """Broadcast every chunk; raise the first local error after all ranks have stopped."""
        from mpi4py import MPI

        self._schedule = schedule
        depth = len(self.slots)
        reads: queue.SimpleQueue[tuple[Chunk, _Slot] | None] = queue.SimpleQueue()
        writes: queue.Queue[tuple[Chunk, _Slot] | None] = queue.Queue(maxsize=depth)
        threads = [threading.Thread(target=self._reader, args=(reads,), name="azcp-readahead", daemon=True)]
        threads += [
            threading.Thread(target=self._writer, args=(writes,), name=f"azcp-bcast-writer-{i}", daemon=True)
            for i in range(self.writer_count)
        ]
        hashes: queue.SimpleQueue[tuple[Chunk, _Slot] | None] = queue.SimpleQueue()
        if self.verify:
            threads.append(threading.Thread(target=self._hasher, args=(hashes,), name="azcp-md5", daemon=True))
        self._hashes = hashes
        for thread in threads:
            thread.start()
        self._reads = reads
        for seq in range(min(depth, len(schedule))):
            self._prepare(seq)
        inflight: deque[tuple[Chunk, _Slot, list[Any]]] = deque()
        stopped_for_peer = False
        try:
            for chunk in schedule:
                while len(inflight) >= depth:
                    self._retire(inflight.popleft(), writes)
                slot = self.slots[chunk.seq % depth]
                # While this rank's read-ahead fills the slot, the chunks already posted
                # go on: MPI moves a nonblocking broadcast only inside MPI calls, and a
                # finished chunk goes to the writers now, not after the next read (which
                # had left the disk without writes while the reads ran).
                while not slot.ready.is_set():
                    if not inflight:
                        slot.ready.wait()  # nothing to move meanwhile: no need to poll
                    elif MPI.Request.Testall(inflight[0][2]):
                        self._retire(inflight.popleft(), writes)
                    else:
                        slot.ready.wait(POLL_NAP)
                slot.ready.clear()
                view = slot.buffer[: chunk.length]
                requests = [
                    self.comm.Ibcast([view[start:stop], MPI.BYTE], root=chunk.root)
                    for start, stop in call_slices(chunk.length)
                ]
                inflight.append((chunk, slot, requests))
                if self._error is None:
                    stop = self.stop_requested()  # a signal: never leave here, stop at the check
                    if stop is not None:
                        self._fail(stop)
                if (chunk.seq + 1) % CHECK_EVERY == 0:
                    failed = self.comm.allreduce(0 if self._error is None else 1) > 0
                    if failed:
                        stopped_for_peer = self._error is None
                        break
            while inflight:
                self._retire(inflight.popleft(), writes)
        finally:
            while inflight:  # stopping early: complete what was posted, every rank alike
                chunk, slot, requests = inflight.popleft()
                MPI.Request.Waitall(requests)
                slot.ready.set()
            reads.put(None)
            hashes.put(None)
            for _ in range(self.writer_count):
                writes.put(None)
            for thread in threads:
                thread.join()
        if self._error is not None:
            raise self._error
        if stopped_for_peer:
            raise PeerFailed()
        return self.stats

    def _retire(self, item: tuple[Chunk, _Slot, list[Any]], writes: queue.Queue[tuple[Chunk, _Slot] | None]) -> None:
        """Complete the oldest broadcast in flight and pass its slot on."""

        chunk, slot, requests = item
        _wait(requests)
        self.stats.chunks += 1
        self.on_bytes(chunk.length)
        if chunk.root == self.rank:
            self.stats.sent_bytes += chunk.length
        write = (
            self._error is None
            and not self.have[chunk.file]
            and (chunk.root != self.rank or self.source_of(chunk.file) is not None)
        )
        hash_it = self.verify and self._error is None
        slot.users = int(write) + int(hash_it)
        if slot.users == 0:
            self._release(chunk, slot)  # sent, failed, or already here: nothing reads the slot
            return
        if hash_it:
            self._hashes.put((chunk, slot))
        if write:
            self.stats.received_bytes += chunk.length
            writes.put((chunk, slot))

    # -- slots ----------------------------------------------------------------------------

    def _release(self, done: Chunk, slot: _Slot) -> None:
        """The slot's chunk is finished with: prepare it for the chunk ``pipeline`` later."""
        self._prepare(done.seq + len(self.slots))

    def _done_with(self, chunk: Chunk, slot: _Slot) -> None:
        """A writer or the hasher is done with the slot; the last one releases it."""
        with slot.lock:
            slot.users -= 1
            last = slot.users == 0
        if last:
            self._release(chunk, slot)

    def _prepare(self, seq: int) -> None:
        if seq >= len(self._schedule):
            return
        chunk = self._schedule[seq]
        slot = self.slots[seq % len(self.slots)]
        if chunk.root == self.rank and self._error is None:
            self._reads.put((chunk, slot))  # the read-ahead thread sets ready when filled
        else:
            slot.ready.set()

    def _fail(self, error: AzcpError) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error

    # -- threads --------------------------------------------------------------------------

    def _serve(
        self,
        jobs: queue.SimpleQueue[tuple[Chunk, _Slot] | None] | queue.Queue[tuple[Chunk, _Slot] | None],
        work: Callable[[Chunk, _Slot], None],
        done: Callable[[Chunk, _Slot], None],
        what: str,
    ) -> None:
        """A thread's loop: ``work`` each job, record any failure, and always call ``done``.

        A thread that died would leave its slot waiting forever, so nothing escapes.
        """
        while True:
            job = jobs.get()
            if job is None:
                return
            chunk, slot = job
            try:
                work(chunk, slot)
            except AzcpError as exc:
                self._fail(exc)
            except BaseException as exc:
                self._fail(InternalError(f"{what} failed: {type(exc).__name__}: {exc}"))
            finally:
                done(chunk, slot)

    def _reader(self, jobs: queue.SimpleQueue[tuple[Chunk, _Slot] | None]) -> None:
        # One file stays open across its chunks: (reader, file index, its stat when opened).
        current: list[tuple[DirectReader, int, os.stat_result]] = []

        def read(chunk: Chunk, slot: _Slot) -> None:
            if self._error is not None:
                return
            shown, opener = self._source(chunk)
            outside = self.source_of(chunk.file) is not None
            try:
                if current and current[0][1] != chunk.file:
                    current.pop()[0].close()
                if not current:
                    direct = self.direct and self._downloaded(chunk)
                    reader = DirectReader(shown, direct=direct, opener=opener)
                    current.append((reader, chunk.file, os.fstat(reader.fd)))
                    if outside and not self._as_listed(chunk.file, current[0][2]):
                        self.changed.add(chunk.file)  # changed since it was listed
                self._advise_next(chunk)
                reader, _, opened = current[0]
                got = reader.read_at(slot.buffer, chunk.length, chunk.offset)
                if outside and chunk.last_of_file and not _same_version(opened, os.fstat(reader.fd)):
                    self.changed.add(chunk.file)  # written to while it was read
            except OSError as exc:
                if outside:
                    raise SourceError(f"cannot read the file: {exc.strerror or exc}", path=shown) from None
                raise fs_error(exc, shown, "read back") from None
            if got != chunk.length:
                if outside:
                    self.changed.add(chunk.file)  # shorter than listed: truncated meanwhile
                    return
                raise BroadcastError(f"short read ({got} of {chunk.length} bytes)", path=shown)

        try:
            self._serve(jobs, read, lambda chunk, slot: slot.ready.set(), "read-ahead")
        finally:
            if current:
                current[0][0].close()

    def _downloaded(self, chunk: Chunk) -> bool:
        """Whether the owner reads the chunk from its own download of this run.

        Those were written with O_DIRECT, so none of it is cached: read back with O_DIRECT
        too. A local SOURCE or a copy from an earlier run may well be cached: read through
        the cache, with the read-ahead hint.
        """
        return self.source_of(chunk.file) is None and not self.have[chunk.file]

    def _reads_direct(self, chunk: Chunk) -> bool:
        """Whether the owner will read the chunk with O_DIRECT (unless the filesystem refuses)."""
        return self.direct and self._downloaded(chunk) and chunk.offset % ALIGN == 0

    def _advise_next(self, chunk: Chunk) -> None:
        """Ask the kernel to start reading this rank's next chunk to send while this one is read.

        For a chunk read through the page cache (a local SOURCE, a copy this rank already
        had, or a download at an unaligned offset), whatever the current one: the hint turns
        the next read into a cache hit without a thread of our own. A chunk that will be
        read with O_DIRECT gets none: the hint would read it a second time, into the cache.
        """
        for later in self._schedule[chunk.seq + 1 : chunk.seq + 1 + 4 * len(self.slots)]:
            if later.root == self.rank:
                if self._reads_direct(later):
                    return
                try:
                    fd = self._source(later)[1](os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, later.offset, later.length, os.POSIX_FADV_WILLNEED)
                    finally:
                        os.close(fd)
                except (OSError, AzcpError):
                    pass  # only a hint
                return

    def _writer(self, jobs: queue.Queue[tuple[Chunk, _Slot] | None]) -> None:
        def write(chunk: Chunk, slot: _Slot) -> None:
            if self._error is not None:
                return
            try:
                rel = self.files[chunk.file].path
                target = DirectFile(self._path(chunk), direct=self.direct, opener=self.tree.opener(rel, temp=True))
                try:
                    target.write_at(slot.buffer[: chunk.length], chunk.offset)
                finally:
                    if target.refused:
                        self.stats.direct_refused = target.path
                    target.close()
            except OSError as exc:
                raise fs_error(exc, self._path(chunk), "write") from None

        self._serve(jobs, write, self._done_with, "writer")

    def _hasher(self, jobs: queue.SimpleQueue[tuple[Chunk, _Slot] | None]) -> None:
        # One thread, fed in schedule order: each file's chunks arrive in offset order.
        state: dict[str, Any] = {"md5": None}

        def update(chunk: Chunk, slot: _Slot) -> None:
            if chunk.offset == 0 or state["md5"] is None:
                state["md5"] = hashlib.md5(usedforsecurity=False)
            state["md5"].update(memoryview(slot.buffer[: chunk.length]))  # type: ignore[arg-type]
            if chunk.last_of_file:
                self.digests[chunk.file] = base64.b64encode(state["md5"].digest()).decode("ascii")
                state["md5"] = None

        self._serve(jobs, update, self._done_with, "hashing")

    def _path(self, chunk: Chunk) -> str:
        return self.tree.temp_shown(self.files[chunk.file].path)

    def _source(self, chunk: Chunk) -> tuple[str, Opener]:
        """Where the owner reads a chunk (for messages, and its opener): the local SOURCE, its
        complete copy, or its download."""
        outside = self.source_of(chunk.file)
        if outside is not None:
            return outside, source_opener(outside)
        rel = self.files[chunk.file].path
        if self.have[chunk.file]:
            return self.tree.shown(rel), self.tree.opener(rel, temp=False)
        return self.tree.temp_shown(rel), self.tree.opener(rel, temp=True)

    def _as_listed(self, index: int, st: os.stat_result) -> bool:
        """Whether a local SOURCE file opened now is the version that was listed."""
        entry = self.files[index]
        return st.st_size == entry.size and local_etag(st) == entry.etag


def _same_version(before: os.stat_result, after: os.stat_result) -> bool:
    """Whether a file was left alone between two stats (size, mtime and ctime: a write moves
    mtime, and a write that sets mtime back still moves ctime)."""
    return (before.st_size, before.st_mtime_ns, before.st_ctime_ns) == (
        after.st_size,
        after.st_mtime_ns,
        after.st_ctime_ns,
    )


def _wait(requests: list[Any]) -> None:
    """Complete ``requests``, testing and napping instead of spinning in MPI_Waitall.

    A blocking wait busy-polls a whole core; the writer and read-ahead threads of this rank
    (and, on an oversubscribed node, other ranks) need it more. A chunk takes milliseconds,
    so a nap of a fraction of one costs nothing.
    """
    from mpi4py import MPI

    while not MPI.Request.Testall(requests):
        time.sleep(POLL_NAP)


__all__ = ["BroadcastStats", "Broadcaster"]
