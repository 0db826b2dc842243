"""Fan every byte out to the nodes that need it: the driver of :mod:`azcp_cluster.core.fanout`.

The schedule (:mod:`azcp_cluster.core.schedule`) is a list of transfers; the state machine
(:class:`azcp_cluster.core.fanout.FanOut`) decides when each slot is read, posted, written and
released. This module owns what the machine does not: ``pipeline`` slots of the largest
transfer's size, page-aligned and allocated once; a read-ahead thread that fills a slot
from the source, the node's download or a complete copy; ``writers`` threads that write
the extents of a completed slot (O_DIRECT where the extent allows it, see
``schedule.Extent.direct``) and a hasher thread (``--verify stream``); and the MPI calls,
made on this (the main) thread only: one ``MPI_Ibcast`` per transfer that every other rank
receives, point-to-point sends and receives for a transfer with fewer receivers.

Errors never leave a rank behind in a collective: a rank that fails keeps taking part
(without touching the disk) until the next agreement, where all ranks stop together.
Streaming (the download still running) adds one input: which transfers' bytes have landed
on this node (see :class:`Landed`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from azcp_cluster.core.errors import AzcpError, BroadcastError, InternalError, SourceError
from azcp_cluster.core.fanout import Agree, Drain, FanOut, Finish, Hash, Instruction, Post, Read, Write
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.plan import round_up
from azcp_cluster.core.schedule import Extent, Transfer, completions, streamed_files
from azcp_cluster.dest.desttree import DestTree, source_opener, split
from azcp_cluster.dest.directio import ALIGN, DirectFile, DirectReader, Opener, aligned_buffer
from azcp_cluster.dest.diskwriter import DiskWriter
from azcp_cluster.dest.localfs import fs_error, pwritev_all
from azcp_cluster.dest.localsource import as_listed
from azcp_cluster.fanout.transport import Request, Transport
from azcp_cluster.run.cluster import PeerFailed, redact
from azcp_cluster.run.interrupts import shield

# Seconds between tests of a transfer in flight: from POLL_NAP, doubling while nothing
# happens, up to MAX_NAP. MPI moves a transfer only inside MPI calls, so the first naps are
# short; a long wait (a root's bytes still downloading) then costs little CPU, which the
# download running on the same cores needs (the streaming benchmark, 2 ranks as 2 nodes on
# 2 cores: the streamed stage 1.59 -> 1.51 s). A 16 MiB transfer takes about 10 ms here, so
# 2 ms is a small delay.
POLL_NAP = 0.0002
MAX_NAP = 0.002
# Seconds between looks at signals, landings and peers while nothing is in flight.
IDLE_NAP = 0.005


@dataclass
class BroadcastStats:
    """What one rank's broadcast did."""

    sent_bytes: int = 0
    received_bytes: int = 0
    chunks: int = 0  # transfers this rank took part in
    source_bytes: int = 0  # bytes read from a local SOURCE
    direct_refused: str = ""  # a path whose filesystem refused O_DIRECT, if any


class Landed(Protocol):
    """Streaming: what the download has put on this node so far (polled on the MPI thread)."""

    def waits(self, seq: int) -> bool:
        """Whether transfer ``seq`` (rooted here) must wait for downloaded bytes."""

    def poll(self) -> list[int]:
        """The transfers rooted here whose bytes have all landed since the last poll."""

    def failed(self) -> AzcpError | None:
        """This rank's own download error, if any (a peer's shows in ``peer_failed``)."""


class _Slot:
    """One pipeline buffer."""

    def __init__(self, size: int) -> None:
        # Rounded up to whole blocks: an O_DIRECT read of an extent with an unaligned end
        # (a file's last) reads the whole last block. One byte more: the root's ``intact``
        # flag, sent right after a transfer's bytes (fanout.py).
        self.buffer = aligned_buffer(round_up(size + 1, ALIGN), populate=True)


class Broadcaster:
    """Drives one rank's :class:`FanOut` over a schedule: read ahead (root), MPI (all), write behind."""

    def __init__(
        self,
        transport: Transport,
        files: Sequence[FileEntry],
        tree: DestTree,
        slot_size: int,
        *,
        pipeline: int = 4,
        writers: int = 2,
        direct: bool = True,
        have: Sequence[bool] | None = None,
        verify: bool = False,
        on_bytes: Callable[[int, int], None] = lambda n, files: None,
        source_of: Callable[[int], str | None] | None = None,
        stop_requested: Callable[[], AzcpError | None] = lambda: None,
        peer_failed: Callable[[], bool] = lambda: False,
        announce: Callable[[], None] = lambda: None,
        made_on_arrival: set[int] | None = None,
        disk: DiskWriter | None = None,
        on_written: Callable[[int, int, int], None] | None = None,
    ) -> None:
        if pipeline < 1 or writers < 1:
            raise ValueError("pipeline and writers must be at least 1")
        self.transport = transport
        self.rank = transport.rank
        self.files = files
        self.tree = tree
        self.direct = direct
        # Files this rank already has under their final names: it sends them from there
        # (peers before Azure) and does not write them again.
        self.have = have if have is not None else [False] * len(files)
        # A local SOURCE's reader sends from the source itself, not from a downloaded
        # temporary file, so it writes its own copy of what it sends like a receiver.
        self.source_of = source_of if source_of is not None else (lambda index: None)
        self.on_bytes = on_bytes  # (bytes, files complete) per transfer done: the progress bar
        self._completes: list[int] = []
        # Polled at every turn of the loop (a SIGINT/SIGTERM this rank got): its error fails
        # this rank like a local one, so the next agreement stops every rank together.
        self.stop_requested = stop_requested
        # Streaming: another rank's failure (a downloader of this node, say) seen before the
        # next agreement, so a root stops waiting for bytes that will not come.
        self.peer_failed = peer_failed
        # Called once when this rank fails: tells every other rank at once (the failure
        # signal), so a root waiting for bytes from a download elsewhere, and the downloads
        # themselves, stop before the next agreement.
        self.announce = announce
        self._announced = False
        # Small files whose temporary name the writer creates as their bytes arrive
        # (DestTree.prepare_all deferred them): always packed, never O_DIRECT.
        self.made_on_arrival = made_on_arrival if made_on_arrival is not None else set()
        self.stats = BroadcastStats()
        self.slots = [_Slot(slot_size) for _ in range(pipeline)]
        self.writer_count = writers  # writer jobs one transfer's extents are spread over
        # The node's disk writers (shared with the download when both run at once), else our own.
        self.disk = disk
        # (file, offset, length) once written (not yet durable): the block journal's feed.
        self.on_written = on_written if on_written is not None else (lambda file, offset, length: None)
        self._schedule: Sequence[Transfer] = ()
        # --verify stream: every file whose bytes pass this rank's slots in order is hashed
        # as it streams past (no second read of anything it wrote).
        self.verify = verify
        self.digests: dict[int, str] = {}
        # A local SOURCE's files that changed while they were read (or since they were
        # listed): their copies are torn, and the pipeline reads them again or fails.
        self.changed: set[int] = set()
        self._events: queue.SimpleQueue[tuple[str, int, AzcpError | None]] = queue.SimpleQueue()

    def release(self) -> None:
        """Free the slots and the per-file state once the fan-out has ended normally (a second
        round maps its own; the verify and the rename need none). Its digests and changed
        files are the caller's to have taken first."""
        self.slots = []
        self.have = []
        self._schedule = ()
        self._completes = []
        self.digests = {}

    # -- the MPI side (main thread) -------------------------------------------------------

    def run(
        self, schedule: Sequence[Transfer], landed: Landed | None = None, failed: AzcpError | None = None
    ) -> BroadcastStats:
        """Carry out every transfer this rank takes part in; raise the first local error after all ranks stopped.

        ``landed``: streaming, the download still running (see :class:`Landed`). ``failed``:
        this rank failed before the fan-out began (its download could not be set up): it takes
        part without reading or writing until the first agreement, where all ranks stop, as it
        does when anything else fails before its first post here (its threads cannot start).
        """
        self._schedule = schedule
        self._completes = completions(schedule)
        rank = self.rank
        hashed = streamed_files(schedule, rank, [f.size for f in self.files]) if self.verify else set()

        def writes(transfer: Transfer, extent: Extent) -> bool:
            if self.have[extent.file]:
                return False
            return transfer.root != rank or self.source_of(extent.file) is not None

        machine = FanOut(
            rank,
            schedule,
            len(self.slots),
            writes,
            hashes=hashed.__contains__,
            writers=self.writer_count,
            waits_landing=landed.waits if landed is not None else (lambda seq: False),
        )
        reads: queue.SimpleQueue[Read | None] = queue.SimpleQueue()
        hashes: queue.SimpleQueue[Hash | None] = queue.SimpleQueue()
        threads: list[threading.Thread] = []
        own_disk = self.disk is None
        disk = self.disk
        try:
            threads.append(threading.Thread(target=self._reader, args=(reads,), name="azcp-readahead", daemon=True))
            if hashed:
                threads.append(threading.Thread(target=self._hasher, args=(hashes,), name="azcp-md5", daemon=True))
            for thread in threads:
                thread.start()
            if disk is None:
                disk = DiskWriter(self.writer_count, name="azcp-bcast-writer")
        except Exception as exc:  # no thread (a process limit): fail here, but never leave the others
            failed = failed or _as_error(exc, "starting the fan-out's threads")
        threads = [t for t in threads if t.ident is not None]  # only the started ones are joined
        if failed is not None:
            machine.failed(failed)  # before start(): nothing is read or written, everything posted
        inflight: deque[tuple[Transfer, Request, int]] = deque()  # (transfer, its calls, its slot)
        todo: deque[Instruction] = deque(machine.start())
        finish: Finish | None = None
        nap = POLL_NAP
        try:
            while finish is None:
                while todo:
                    step = todo.popleft()
                    if isinstance(step, Read):
                        reads.put(step)
                    elif isinstance(step, Post):
                        transfer = schedule[step.seq]
                        buffer = self.slots[step.slot].buffer
                        # The root says whether the slot holds the bytes; a receiver's byte is
                        # overwritten by the root's (0 until then).
                        buffer[transfer.length] = 1 if step.intact and transfer.root == self.rank else 0
                        inflight.append((transfer, self._post(transfer, buffer), step.slot))
                    elif isinstance(step, Write):
                        try:
                            if disk is None:
                                raise RuntimeError("no disk writer")
                            disk.submit(self._work(step), self._reported(step.seq, "writer"))
                        except Exception as exc:  # (a closed writer): the write fails, reported as one
                            self._reported(step.seq, "writer")(exc)
                        else:
                            self.stats.received_bytes += sum(e.length for e in step.extents)
                    elif isinstance(step, Hash):
                        hashes.put(step)
                    elif isinstance(step, Agree):
                        any_failed = self.transport.agree(step.failed)
                        todo.extend(machine.agreed(any_failed))
                    elif isinstance(step, Drain):
                        while inflight:
                            self.transport.wait(inflight.popleft()[1])
                    else:
                        finish = step
                        break
                if finish is not None:
                    break
                todo.extend(self._events_now(machine, landed))
                if todo:
                    nap = POLL_NAP
                    continue
                if inflight and self.transport.test(inflight[0][1]):
                    transfer, _, slot = inflight.popleft()
                    intact = self.slots[slot].buffer[transfer.length] == 1
                    try:
                        if intact or transfer.root == self.rank:
                            self._retired(transfer)  # counters and the progress bar
                    except Exception as exc:  # fail this rank; never leave the others in a collective
                        todo.extend(machine.failed(_as_error(exc, "the fan-out")))
                    todo.extend(machine.call_done(intact))
                    nap = POLL_NAP
                    continue
                # Nothing to do until a thread, MPI or the download moves: nap, then look
                # again, testing MPI (which moves only inside MPI calls) often. A nap, not a
                # timed wait on the events queue: a signal landing in that wait can hang it
                # (see interrupts.shield).
                time.sleep(nap if inflight else IDLE_NAP)
                nap = min(nap * 2, MAX_NAP)
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    continue
                nap = POLL_NAP
                todo.extend(self._event(machine, event))
        finally:
            while inflight:  # leaving early (an exception here): complete what was posted
                self.transport.wait(inflight.popleft()[1])
            reads.put(None)
            hashes.put(None)
            for thread in threads:
                thread.join()
            if own_disk and disk is not None:
                disk.close()  # after the queued writes (a shared one: its owner closes it)
        if finish.error is not None:
            raise finish.error
        if finish.peer:
            raise PeerFailed()
        return self.stats

    def _events_now(self, machine: FanOut, landed: Landed | None) -> list[Instruction]:
        """What happened since the last look: thread events, a signal, landings, a peer's failure."""
        out: list[Instruction] = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            out.extend(self._event(machine, event))
        try:
            if machine.error is None:
                stop = self.stop_requested()
                if stop is None and landed is not None:
                    stop = landed.failed()
                if stop is not None:
                    out.extend(machine.failed(stop))
            if landed is not None and not machine.finished:
                for seq in landed.poll():
                    out.extend(machine.landed(seq))
                if not machine.failing and self.peer_failed():
                    out.extend(machine.failed(None))
        except Exception as exc:  # a bug here must fail this rank, not leave the others in a collective
            out.extend(machine.failed(_as_error(exc, "the fan-out") or InternalError("the fan-out failed")))
        if machine.error is not None and not self._announced:
            self._announced = True
            with contextlib.suppress(Exception):  # the agreement still tells the others
                self.announce()
        return out

    def _event(self, machine: FanOut, event: tuple[str, int, AzcpError | None]) -> list[Instruction]:
        kind, seq, error = event
        if kind == "read":
            return machine.read_done(seq, error)
        return machine.write_done(seq, error)

    def _post(self, transfer: Transfer, buffer: Any) -> Request:
        """Start a transfer: its bytes and the root's ``intact`` byte after them, to every other
        rank or to its receivers."""
        receivers = None if transfer.everyone else transfer.receivers
        return self.transport.post(buffer[: transfer.length + 1], transfer.root, receivers)

    def _retired(self, transfer: Transfer) -> None:
        """Count a completed transfer."""
        self.stats.chunks += 1
        self.on_bytes(sum(e.length for e in transfer.extents), self._completes[transfer.seq])
        if transfer.root == self.rank:
            self.stats.sent_bytes += transfer.length * len(transfer.receivers)

    # -- threads --------------------------------------------------------------------------

    def _serve(self, jobs: queue.SimpleQueue[Any], work: Callable[[Any], None], kind: str, what: str) -> None:
        """A thread's loop: ``work`` each job and always report it done (with its error, if any).

        A thread that died would leave its slot waiting forever, so nothing escapes.
        """
        shield()
        while True:
            job = jobs.get()
            if job is None:
                return
            error: BaseException | None = None
            try:
                work(job)
            except BaseException as exc:
                error = exc
            self._events.put((kind, job.seq, _as_error(error, what)))

    def _reported(self, seq: int, what: str) -> Callable[[BaseException | None], None]:
        """The disk writer's callback for a job of transfer ``seq``: an event for the MPI thread."""
        return lambda error: self._events.put(("write", seq, _as_error(error, what)))

    def _reader(self, jobs: queue.SimpleQueue[Read | None]) -> None:
        # One file stays open across its extents: (reader, file index, its stat when opened).
        current: list[tuple[DirectReader, int, os.stat_result]] = []

        def read_extent(extent: Extent, slot: _Slot) -> None:
            shown, opener = self._source(extent.file)
            outside = self.source_of(extent.file) is not None
            try:
                if current and current[0][1] != extent.file:
                    current.pop()[0].close()
                if not current:
                    direct = self.direct and self._downloaded(extent.file) and extent.direct
                    reader = DirectReader(shown, direct=direct, opener=opener)
                    current.append((reader, extent.file, os.fstat(reader.fd)))
                    if outside and not self._as_listed(extent.file, current[0][2]):
                        self.changed.add(extent.file)  # changed since it was listed
                reader, _, opened = current[0]
                got = reader.read_at(slot.buffer[extent.at :], extent.length, extent.offset)
                if outside:
                    self.stats.source_bytes += got
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
            if extent.last_of_file and current:
                current.pop()[0].close()  # a small file's descriptor is not kept to the next

        def read(job: Read) -> None:
            transfer = self._schedule[job.seq]
            slot = self.slots[job.slot]
            for extent in transfer.extents:
                read_extent(extent, slot)
            self._advise_next(transfer, current[0][0].fd if current else -1)

        try:
            self._serve(jobs, read, "read", "read-ahead")
        finally:
            if current:
                current[0][0].close()

    def _downloaded(self, index: int) -> bool:
        """Whether the root reads file ``index`` from its own download of this run.

        Those were written with O_DIRECT, so none of it is cached: read back with O_DIRECT
        too. A local SOURCE or a copy from an earlier run may well be cached: read through
        the cache, with the read-ahead hint.
        """
        return self.source_of(index) is None and not self.have[index]

    def _advise_next(self, transfer: Transfer, fd: int) -> None:
        """Ask the kernel to start reading this rank's next transfer while the MPI calls run.

        Only where it costs no open: the next transfer continues the file still open (a
        large file read through the page cache: a local SOURCE, a copy this rank already
        had). A range that will be read with O_DIRECT gets none: the hint would read it a
        second time, into the cache.
        """
        if fd < 0:
            return
        last = transfer.extents[-1]
        for later in self._schedule[transfer.seq + 1 : transfer.seq + 1 + 4 * len(self.slots)]:
            if later.root != self.rank:
                continue
            first = later.extents[0]
            if first.file == last.file and not (self.direct and self._downloaded(first.file) and first.direct):
                with contextlib.suppress(OSError):  # only a hint
                    os.posix_fadvise(fd, first.offset, first.length, os.POSIX_FADV_WILLNEED)
            return

    def _work(self, job: Write) -> Callable[[], None]:
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
            buffer = self.slots[job.slot].buffer
            # Small files packed in one slot lie mostly in a few directories: each run of
            # extents in one directory walks to it once (a large extent walks on its own).
            for folder, extents in self._by_directory(job.extents):
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

    def _by_directory(self, extents: Sequence[Extent]) -> list[tuple[list[str] | None, list[Extent]]]:
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

    def _hasher(self, jobs: queue.SimpleQueue[Hash | None]) -> None:
        # One thread, fed in schedule order: each hashed file's extents arrive in offset order.
        state: dict[int, Any] = {}

        def update(job: Hash) -> None:
            buffer = self.slots[job.slot].buffer
            for extent in job.extents:
                md5 = state.get(extent.file)
                if md5 is None:
                    md5 = state[extent.file] = hashlib.md5(usedforsecurity=False)
                md5.update(memoryview(buffer[extent.at : extent.at + extent.length]))  # type: ignore[arg-type]
                if extent.offset + extent.length == self.files[extent.file].size:  # its last bytes
                    self.digests[extent.file] = base64.b64encode(state.pop(extent.file).digest()).decode("ascii")

        self._serve(jobs, update, "write", "hashing")

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


def _as_error(error: BaseException | None, what: str) -> AzcpError | None:
    """A thread's failure in the project's tree (an unexpected one named by the thread's task)."""
    if error is None or isinstance(error, AzcpError):
        return error
    return InternalError(f"{what} failed: {type(error).__name__}: {redact(str(error))}")


def _same_version(before: os.stat_result, after: os.stat_result) -> bool:
    """Whether a file was left alone between two stats (size, mtime and ctime: a write moves
    mtime, and a write that sets mtime back still moves ctime)."""
    return (before.st_size, before.st_mtime_ns, before.st_ctime_ns) == (
        after.st_size,
        after.st_mtime_ns,
        after.st_ctime_ns,
    )


__all__ = ["BroadcastStats", "Broadcaster", "Landed"]
