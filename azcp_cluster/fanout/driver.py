"""Fan every byte out to the nodes that need it: the driver of :mod:`azcp_cluster.core.fanout`.

The schedule (:mod:`azcp_cluster.core.schedule`) is a list of transfers; the state machine
(:class:`azcp_cluster.core.fanout.FanOut`) decides when each slot is read, posted, written and released. This module
owns what the machine does not: ``pipeline`` slots of the largest transfer's size, page-aligned and allocated once; a
read-ahead thread that fills a slot (:class:`azcp_cluster.fanout.readahead.ReadAhead`: from the source, the node's
download or a complete copy); the node's writer (:class:`azcp_cluster.dest.nodewriter.NodeWriter`), which writes the
extents of a completed slot (O_DIRECT where the extent allows it, see ``schedule.Extent.direct``), spread over
``writers`` jobs; a hasher thread (``--verify stream``, :class:`azcp_cluster.core.digests.StreamDigests`); and the
calls to the other ranks, made on this (the main) thread only, through a
:class:`azcp_cluster.fanout.transport.Transport` (MPI's between the node leaders; threads of one process in tests).

The driver is a dispatcher: what happens (a read or write done, a transfer complete, an agreement's answer, bytes
landed, a failure) becomes a typed event, one call of the machine.

Errors never leave a rank behind in a collective: a rank that fails keeps taking part (without touching the disk) until
the next agreement, where all ranks stop together; an instruction that cannot be carried out fails the rank the same
way, its calls to the other ranks still made. Streaming (the download still running) adds one input: which transfers'
bytes have landed on this node (see :class:`LandingFeed`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from azcp_cluster.core.digests import StreamDigests
from azcp_cluster.core.errors import AzcpError, InternalError
from azcp_cluster.core.fanout import Agree, Drain, FanOut, Finish, Hash, Instruction, Post, Read, Write
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.naps import Naps
from azcp_cluster.core.schedule import Extent, Transfer, completions, streamed_files
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.fanout.events import (
    NO_HOOKS,
    Agreed,
    CallDone,
    Event,
    Failed,
    FanOutStats,
    HeldBlocks,
    LandedHere,
    LandingFeed,
    ReadDone,
    StageHooks,
    WriteDone,
    as_error,
)
from azcp_cluster.fanout.readahead import ReadAhead
from azcp_cluster.fanout.runstate import InFlight, Run
from azcp_cluster.fanout.slot import Slot
from azcp_cluster.fanout.transport import Request, Transport
from azcp_cluster.run.cluster import PeerFailed
from azcp_cluster.run.interrupts import shield

# Seconds between tests of a transfer in flight: from POLL_NAP, doubling while nothing
# happens, up to MAX_NAP (core/naps.py). MPI moves a transfer only inside MPI calls, so the
# first naps are short; a long wait (a root's bytes still downloading) then costs little of
# the CPU the download on the same cores needs (docs/benchmarks.md has the figures).
POLL_NAP = 0.0002
MAX_NAP = 0.002  # a small delay beside a slot's transfer time (milliseconds)
# Seconds between looks at signals, landings and peers while nothing is in flight.
IDLE_NAP = 0.005
_Job = TypeVar("_Job", Read, Hash)  # what a thread of the driver serves (the read-ahead, the hasher)


class FanOutDriver:
    """Drives one rank's :class:`FanOut` over a schedule: read ahead (root), MPI (all), write behind."""

    def __init__(
        self,
        transport: Transport,
        files: Sequence[FileEntry],
        tree: DestTree,
        slot_size: int,
        writer: NodeWriter,
        *,
        pipeline: int = 4,
        populated: int | None = None,
        writers: int = 2,
        direct: bool = True,
        have: Sequence[bool] | None = None,
        verify: bool = False,
        source_of: Callable[[int], str | None] | None = None,
        source_pieces: Callable[[int, int, int, int], None] | None = None,
        stream_crcs: dict[int, int] | None = None,
        stop_requested: Callable[[], AzcpError | None] = lambda: None,
    ) -> None:
        if pipeline < 1 or writers < 1:
            raise ValueError("pipeline and writers must be at least 1")
        populated = pipeline if populated is None else populated
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
        self.source_pieces = source_pieces  # --verify: told each extent read from a local SOURCE, with its CRC
        self.stream_crcs = stream_crcs  # --verify: each file's CRC-32 hashed in flight (with its MD5)
        self._completes: list[int] = []
        # Polled at every turn of the loop (a SIGINT/SIGTERM this rank got): its error fails
        # this rank like a local one, so the next agreement stops every rank together.
        self.stop_requested = stop_requested
        self._announced = False  # the stage's hooks were told this rank failed (StageHooks.announce)
        self.stats = FanOutStats()
        # The first ``populated`` slots mapped now, the rest at first use (allocate.POPULATED_SLOTS).
        self.slots = [Slot(slot_size, populate=i < populated) for i in range(pipeline)]
        self.writer_count = writers  # writer jobs one transfer's extents are spread over
        # The node's writer (shared with the download when both run at once; its maker closes
        # it): it creates the small files made on arrival and feeds the block journal.
        self.writer = writer
        self._schedule: Sequence[Transfer] = ()
        # --verify stream: every file whose bytes pass this rank's slots in order is hashed
        # as it streams past (no second read of anything it wrote).
        self.verify = verify
        self.digests: dict[int, str] = {}
        # A local SOURCE's files that changed while they were read (or since they were
        # listed): their copies are torn, and the pipeline reads them again or fails.
        self.changed: set[int] = set()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def release(self) -> None:
        """Free the slots and the per-file state once the fan-out has ended normally (a second
        round maps its own; the verify and the rename need none). Its digests and changed
        files are the caller's to have taken first."""
        self.slots = []
        self.have = []
        self._schedule = ()
        self._completes = []
        self.digests = {}

    # -- the driver (main thread) ----------------------------------------------------------

    def run(
        self,
        schedule: Sequence[Transfer],
        hooks: StageHooks = NO_HOOKS,
        feed: LandingFeed | None = None,
        failed: AzcpError | None = None,
        held: HeldBlocks | None = None,
    ) -> FanOutStats:
        """Carry out every transfer this rank takes part in; raise the first local error after all ranks stopped.

        ``hooks``: the stage's. ``feed``: streaming, the download still running (see
        :class:`LandingFeed`); ``held``: its buffers, a root's transfers copied from them. ``failed``:
        this rank failed before the fan-out began (its download could not be set up): it takes
        part without reading or writing until the first agreement, where all ranks stop, as it
        does when anything else fails before its first post here (its threads cannot start).
        """
        run = self._begin(schedule, hooks, feed, failed, held)
        try:
            finish = self._drive(run)
        finally:
            self._end(run)
        if finish.error is not None:
            raise finish.error
        if finish.peer:
            raise PeerFailed()
        return self.stats

    def _begin(
        self,
        schedule: Sequence[Transfer],
        hooks: StageHooks,
        feed: LandingFeed | None,
        failed: AzcpError | None,
        held: HeldBlocks | None,
    ) -> Run:
        """The machine for ``schedule``, the read-ahead, hasher and writer threads started, the first instructions."""
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
            waits_landing=feed.waits if feed is not None else (lambda seq: False),
        )
        reader = ReadAhead(
            self.files,
            self.tree,
            schedule,
            rank,
            have=self.have,
            source_of=self.source_of,
            direct=self.direct,
            hint_window=4 * len(self.slots),
            changed=self.changed,
            held=held,
            source_pieces=self.source_pieces,
        )
        run = Run(schedule, machine, hooks, feed, reader, StreamDigests(self.digests, self.stream_crcs))
        try:
            self._start_threads(run, hashed=bool(hashed))
        except Exception as exc:  # no thread (a process limit): fail here, but never leave the others
            failed = failed or as_error(exc, "starting the fan-out's threads")
        run.threads = [t for t in run.threads if t.ident is not None]  # only the started ones are joined
        if failed is not None:
            # Before start(): nothing is read or written, everything posted. What it asks for
            # (an agreement, for a rank whose first transfer is past one) is carried out first.
            run.todo.extend(machine.failed(failed))
        run.todo.extend(machine.start())
        return run

    def _start_threads(self, run: Run, hashed: bool) -> None:
        """The read-ahead thread and the hasher (if any file is hashed)."""
        run.threads.append(threading.Thread(target=self._reader, args=(run,), name="azcp-readahead", daemon=True))
        if hashed:
            run.threads.append(threading.Thread(target=self._hasher, args=(run,), name="azcp-md5", daemon=True))
        for thread in run.threads:
            thread.start()

    def _end(self, run: Run) -> None:
        """Complete what was posted (leaving early: an exception), stop the threads."""
        try:
            while run.inflight:
                self.transport.wait(run.inflight.popleft().request)
        finally:
            run.reads.put(None)
            run.hashes.put(None)
            for thread in run.threads:
                thread.join()
            self.stats.source_bytes += run.reader.source_bytes
            self.stats.memory_bytes += run.reader.memory_bytes

    def _drive(self, run: Run) -> Finish:
        """Carry out the machine's instructions and feed it what happened, until it says Finish."""
        todo = run.todo
        naps = Naps(POLL_NAP, MAX_NAP)
        while True:
            while todo:
                step = todo.popleft()
                if isinstance(step, Finish):
                    return step
                for event in self._dispatch(run, step):
                    todo.extend(self._handle(run.machine, event))
                if run.meanwhile_error is not None:  # not before: out of the agreement, never in it
                    raise run.meanwhile_error
            todo.extend(self._events_now(run))
            if todo:
                naps.reset()
                continue
            if run.inflight and self.transport.test(run.inflight[0].request):
                for event in self._completed(run):
                    todo.extend(self._handle(run.machine, event))
                naps.reset()
                continue
            # Nothing to do until a thread, the transport or the download moves: nap, then
            # look again, testing the transfer in flight (MPI moves only inside MPI calls)
            # often. A nap, not a timed wait on the events queue: a signal landing in that
            # wait can hang it (see interrupts.shield).
            naps.nap(None if run.inflight else IDLE_NAP)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                continue
            naps.reset()
            todo.extend(self._handle(run.machine, event))

    def _handle(self, machine: FanOut, event: Event) -> list[Instruction]:
        """Tell the machine what happened; what it asks for next."""
        if isinstance(event, ReadDone):
            return machine.read_done(event.seq, event.error)
        if isinstance(event, WriteDone):
            return machine.write_done(event.seq, event.error)
        if isinstance(event, CallDone):
            return machine.call_done(event.intact)
        if isinstance(event, Agreed):
            return machine.agreed(event.any_failed)
        if isinstance(event, LandedHere):
            return machine.landed(event.seq)
        return machine.failed(event.error)

    def _dispatch(self, run: Run, step: Instruction) -> list[Event]:
        """Carry out one instruction; should that fail, fail this rank without leaving the others."""
        try:
            return self._carry_out(run, step)
        except Exception as exc:
            return self._failed_at(run, step, as_error(exc, "the fan-out") or InternalError("the fan-out failed"))

    def _carry_out(self, run: Run, step: Instruction) -> list[Event]:
        """Do what ``step`` says; what came of it at once (an agreement's answer), as events."""
        if isinstance(step, Read):
            run.reads.put(step)
        elif isinstance(step, Post):
            self._send(run, step)
        elif isinstance(step, Write):  # own: this rank roots the transfer (read from a local SOURCE)
            done, own = self._reported(step.seq, "writer"), run.schedule[step.seq].root == self.rank
            self.writer.write_extents(step.extents, self.slots[step.slot].buffer, self.direct, done, self._refused, own)
            self.stats.received_bytes += sum(e.length for e in step.extents)
        elif isinstance(step, Hash):
            run.hashes.put(step)
        elif isinstance(step, Agree):
            # As the rank stands now: a failure since the machine asked (an instruction of
            # the same batch carried out before this one) is not hidden from the others.
            # While the others join, the transfers already posted go on (_meanwhile).
            failed = step.failed or run.machine.failing
            return [Agreed(self.transport.agree(failed, lambda: self._meanwhile(run)))]
        elif isinstance(step, Drain):
            while run.inflight:
                self.transport.wait(run.inflight.popleft().request)
        else:
            raise InternalError(f"the fan-out cannot carry out {step!r}")
        return []

    def _failed_at(self, run: Run, step: Instruction, error: AzcpError) -> list[Event]:
        """Carrying out ``step`` failed (``error``): the events that fail this rank, the step's
        share of the calls still made, so that no other rank waits for it."""
        if isinstance(step, Read):
            return [ReadDone(step.seq, error)]  # never queued: nothing read
        if isinstance(step, Write | Hash):
            return [WriteDone(step.seq, error)]  # never queued: nothing written or hashed
        if isinstance(step, Post):
            if not (run.inflight and run.inflight[-1].transfer.seq == step.seq):
                self._send(run, replace(step, intact=False))  # the others wait for it; it carries nothing
            return [Failed(error)]
        if isinstance(step, Agree):
            return [Failed(error), Agreed(self.transport.agree(True))]
        if isinstance(step, Drain):
            while run.inflight:
                self.transport.wait(run.inflight.popleft().request)
        return [Failed(error)]

    def _send(self, run: Run, step: Post) -> None:
        """Post transfer ``step.seq`` from its slot (the root says whether the slot holds its
        bytes; a receiver's byte is overwritten by the root's, 0 until then)."""
        transfer = run.schedule[step.seq]
        slot = self.slots[step.slot]
        slot.buffer[transfer.length] = 1 if step.intact and transfer.root == self.rank else 0
        run.inflight.append(InFlight(transfer, self._post(transfer, slot), step.slot))

    def _post(self, transfer: Transfer, slot: Slot) -> Request:
        """Start a transfer: its bytes and the root's ``intact`` byte after them, to every other
        rank or to its receivers."""
        receivers = None if transfer.everyone else transfer.receivers
        return self.transport.post(slot.buffer[: transfer.length + 1], transfer.root, receivers)

    def _completed(self, run: Run) -> list[Event]:
        """The oldest transfer in flight completed: count it (if its root's bytes came), then tell the machine."""
        done = run.inflight.popleft()
        transfer = done.transfer
        intact = bool(self.slots[done.slot].buffer[transfer.length] == 1)
        try:
            if intact:  # (a root's own byte: whether it read the slot; a failed root posts unread ones)
                self._retired(run, transfer)  # counters and the progress bar
        except Exception as exc:  # fail this rank; never leave the others in a collective
            return [Failed(as_error(exc, "the fan-out")), CallDone(intact)]
        return [CallDone(intact)]

    def _events_now(self, run: Run) -> list[Instruction]:
        """What happened since the last look: thread events, a signal, landings, a peer's failure."""
        machine, feed = run.machine, run.feed
        out: list[Instruction] = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            out.extend(self._handle(machine, event))
        try:
            if machine.error is None:
                stop = self.stop_requested()
                if stop is None and feed is not None:
                    stop = feed.failed()
                if stop is not None:
                    out.extend(machine.failed(stop))
            if feed is not None and not machine.finished:
                for seq in feed.poll():
                    out.extend(self._handle(machine, LandedHere(seq)))
                if not machine.failing and run.hooks.peer_failed():
                    out.extend(machine.failed(None))
        except Exception as exc:  # a bug here must fail this rank, not leave the others in a collective
            out.extend(machine.failed(as_error(exc, "the fan-out") or InternalError("the fan-out failed")))
        if machine.error is not None and not self._announced:
            self._announced = True
            with contextlib.suppress(Exception):  # the agreement still tells the others
                run.hooks.announce()
        return out

    def _meanwhile(self, run: Run) -> None:
        """While this rank waits in an agreement (called between looks at it; never blocks, never
        raises): the transfers it posted before complete and go to the writers and the hasher,
        the threads' events are heard, a signal is told to the others at once (a streaming root
        then stops its download before it joins). A receiver's slots would otherwise wait,
        unwritten and unjournalled, until the slowest rank joined: a root still downloading the
        bytes of the transfers before the agreement, seconds later. Nothing is posted: the
        machine posts nothing while it agrees."""
        self._announce_stop(run)
        if run.meanwhile_error is not None:
            return
        try:
            todo = deque(self._events_now(run))
            while True:
                while todo:
                    for event in self._dispatch(run, todo.popleft()):
                        todo.extend(self._handle(run.machine, event))
                if not (run.inflight and self.transport.test(run.inflight[0].request)):
                    return
                for event in self._completed(run):
                    todo.extend(self._handle(run.machine, event))
        except Exception as exc:  # never out of the agreement: a second one would be a collective too many
            run.meanwhile_error = exc

    def _announce_stop(self, run: Run) -> None:
        """Tell the other ranks now (the failure signal) if this rank was asked to stop (a signal)."""
        with contextlib.suppress(Exception):  # never fail inside the agreement: it tells them anyway
            if not self._announced and self.stop_requested() is not None:
                self._announced = True
                run.hooks.announce()

    def _retired(self, run: Run, transfer: Transfer) -> None:
        """Count a completed transfer."""
        self.stats.chunks += 1
        run.hooks.on_bytes(sum(e.length for e in transfer.extents), self._completes[transfer.seq])
        if transfer.root == self.rank:
            self.stats.sent_bytes += transfer.length * len(transfer.receivers)

    # -- threads --------------------------------------------------------------------------

    def _serve(
        self,
        jobs: queue.SimpleQueue[_Job | None],
        work: Callable[[_Job], None],
        done: Callable[[int, AzcpError | None], Event],
        what: str,
    ) -> None:
        """A thread's loop: ``work`` each job and always report it ``done`` (with its error, if any).

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
            self._events.put(done(job.seq, as_error(error, what)))

    def _refused(self, path: str) -> None:
        """A filesystem refused O_DIRECT for ``path`` (a writer thread): the report's warning."""
        self.stats.direct_refused = path

    def _reported(self, seq: int, what: str) -> Callable[[BaseException | None], None]:
        """The disk writer's callback for a job of transfer ``seq``: an event for the driver."""
        return lambda error: self._events.put(WriteDone(seq, as_error(error, what)))

    def _reader(self, run: Run) -> None:
        """The read-ahead thread: each Read's slot filled from where its root reads."""

        def read(job: Read) -> None:
            run.reader.read(run.schedule[job.seq], self.slots[job.slot].buffer)

        try:
            self._serve(run.reads, read, ReadDone, "read-ahead")
        finally:
            run.reader.close()

    def _hasher(self, run: Run) -> None:
        """The hasher thread, fed in schedule order: each hashed file's extents arrive in offset order."""

        def update(job: Hash) -> None:
            buffer = self.slots[job.slot].buffer
            for extent in job.extents:
                last = extent.offset + extent.length == self.files[extent.file].size  # its last bytes
                piece = memoryview(buffer[extent.at : extent.at + extent.length])  # type: ignore[arg-type]
                run.digests.add(extent.file, piece, last)

        self._serve(run.hashes, update, WriteDone, "hashing")


__all__ = ["FanOutDriver"]
