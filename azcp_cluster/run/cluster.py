"""The MPI side of the control plane: agreement on errors, timing, and the failure signal.

Every stage ends in :meth:`Cluster.conclude`, one small allgather that carries each rank's
elapsed time, counters and error (if any). All ranks then either go on together or raise
the same typed error, so a failure on one rank never leaves the others waiting in a
collective, and the stage time reported is the slowest rank's.

Ranks that are busy for a long time on their own (downloading) also watch for a
:class:`FailureSignal`, so one rank's failure stops the others promptly.

A SIGINT or SIGTERM (:mod:`azcp_cluster.run.interrupts`) becomes the rank's error at the end of
its stage work and at every agreement, and counts as a failure for :meth:`Cluster.peer_failed`.
"""

from __future__ import annotations

import re
import resource
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from azcp_cluster.core.comm import Comm, Request
from azcp_cluster.core.errors import ERROR_CLASSES, AzcpError, InternalError
from azcp_cluster.core.naps import nap_until
from azcp_cluster.run import liveness
from azcp_cluster.run.figures import TimelineEntry
from azcp_cluster.run.interrupts import Interrupts, signal_error

_FAIL_TAG = 7071
# settle's naps (core/naps.py): 50 us first, so a short wait stays short; 2 ms at most, so
# a long one costs the working ranks no CPU.
SETTLE_NAP = 0.00005
MAX_SETTLE_NAP = 0.002


class PeerFailed(Exception):
    """Raised inside a rank's stage work when another rank has already failed."""


T = TypeVar("T")


@dataclass
class StageOutcome(Generic[T]):
    """What one rank brings to the end of a stage: its error, and its figures (``stats``) for the others."""

    error: AzcpError | None = None
    stats: T | None = None
    notified: bool = False  # this rank sent a FailureSignal


@dataclass(frozen=True)
class StageResult(Generic[T]):
    """What every rank knows after a stage: the slowest time, everyone's figures (by rank), and
    whether some rank failed (its figures so far are still here)."""

    seconds: float
    stats: list[T | None]
    failed: bool = False

    def each(self, missing: T) -> list[T]:
        """Every rank's figures, ``missing`` for a rank that brought none."""
        return [missing if st is None else st for st in self.stats]


def error_payload(error: AzcpError) -> tuple[str, str, str | None, int | None]:
    """Serializable form of an error, for the agreement allgather."""
    return (type(error).__name__, error.message, error.path, error.rank)


def error_from_payload(payload: tuple[str, str, str | None, int | None]) -> AzcpError:
    """Rebuild the typed error on every rank from :func:`error_payload`."""
    name, message, path, rank = payload
    cls = ERROR_CLASSES.get(name, InternalError)
    return cls(message, path=path, rank=rank)


def as_azcp_error(exc: BaseException, rank: int) -> AzcpError:
    """Wrap anything a stage raised into the project's tree, tagged with the rank."""
    if isinstance(exc, AzcpError):
        if exc.rank is None:
            exc.rank = rank
        return exc
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    loc = f" at {where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno}" if where else ""
    return InternalError(f"unexpected {type(exc).__name__}: {redact(str(exc))}{loc}", rank=rank)


_QUERY = re.compile(r"\?[^\s'\"]*")


def redact(text: str) -> str:
    """Drop URL query strings (they may hold a SAS signature) from a message."""
    return _QUERY.sub("?<redacted>", text)


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Cluster:
    """The ranks of one run, over an mpi4py communicator (passed in, never created here)."""

    def __init__(
        self,
        comm: Comm,
        clock: Callable[[], float],
        interrupts: Interrupts | None = None,
        peer_timeout: float | None = None,
    ) -> None:
        self.comm = comm
        # The CLI's signal recorder; by default one that is never installed, so never fires.
        self.interrupts = interrupts if interrupts is not None else Interrupts()
        if self.interrupts.rank is None:
            self.interrupts.rank = comm.Get_rank()
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.clock = clock
        # A private duplicate so our tags and collectives never mix with the caller's.
        self._signal_comm = comm.Dup()
        # Every rank's pulse (``peer_timeout``: a rank silent that long ends the job; None: off).
        self._liveness = liveness.start(comm, peer_timeout)
        self._pending: list[Request] = []  # failure signals sent, completed at the next agreement
        # Where the time goes: this rank's stage spans, in seconds since ``origin`` (its run's
        # start), carried to every rank by the next agreement (:meth:`note`), and what the
        # agreements have gathered so far: one entry per stage, each rank's start and end.
        self.origin = clock()
        self.wall_origin = time.time()  # the same instant on the wall clock, to align ranks and hosts
        self._spans: list[tuple[str, float, float]] = []
        self.timeline: list[TimelineEntry] = []
        self.origins: list[float] = []  # every rank's wall_origin, once an agreement has carried them
        # The largest peak resident memory of any rank, as of the last agreement (each carries
        # every rank's): known at the end of a failed run too, whatever stage it failed in.
        self.peak_rss = 0

    def close(self, agreed: bool = True) -> None:
        """Release the communicators duplicated for the pulse and the signals; ``agreed`` (every
        rank ends its run here): first send this rank's last pulse and take the one before's.
        Not agreed (one rank's unexpected error): its pulse just stops, nothing is waited for."""
        if self._liveness is not None:
            self._liveness.stop(handshake=agreed)
            self._liveness = None
        self._signal_comm.Free()

    # -- agreement ------------------------------------------------------------------------

    @contextmanager
    def stage(self, outcome: StageOutcome[T]) -> Iterator[StageOutcome[T]]:
        """Run a rank's stage work, capturing any error into ``outcome`` instead of raising."""
        try:
            yield outcome
        except PeerFailed:
            pass  # the failed rank reports; this one just stops
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):  # SIGINT under a host program's default handler
                outcome.error = self.interrupted() or signal_error(signal.SIGINT, self.rank)
            elif isinstance(exc, SystemExit):
                outcome.error = InternalError(f"interrupted ({type(exc).__name__})", rank=self.rank)
            else:
                outcome.error = as_azcp_error(exc, self.rank)
        # Before the stage's own failure signalling (the download's), so a signal also stops the others.
        self._note_interrupt(outcome)

    def interrupted(self) -> AzcpError | None:
        """The error for a SIGINT or SIGTERM this rank has received, or None (never blocks)."""
        return self.interrupts.error(self.rank)

    def abandonable(self) -> AbstractContextManager[None]:
        """Rank-local work a signal may stop at once (see :meth:`Interrupts.abandonable`)."""
        return self.interrupts.abandonable(self.rank)

    def _note_interrupt(self, outcome: StageOutcome[T]) -> None:
        if outcome.error is None:
            outcome.error = self.interrupted()

    def conclude(
        self,
        started: float,
        outcome: StageOutcome[T],
        record: Callable[[StageResult[T]], None] | None = None,
        stage: str = "",
    ) -> StageResult[T]:
        """End a stage on every rank: raise the agreed error, or return times and counters.

        ``record`` takes the gathered times and counters before either: a failed stage's
        figures so far (bytes, retries) still reach the report. ``stage``: its name in the
        timeline, from ``started`` to now (this rank's work, before the agreement's wait).
        """
        elapsed = self.clock() - started
        if stage:
            self.note(stage, started)

        def interrupted_while_waiting() -> None:
            # A signal on a rank that waits here (nothing to download, a non-leader) also
            # stops the ranks still downloading: they poll for the failure signal.
            if outcome.error is None and self.interrupts.stopping:
                self._note_interrupt(outcome)
                self.signal_failure(outcome)

        interrupted_while_waiting()
        self.settle(interrupted_while_waiting)
        interrupted_while_waiting()  # up to the last moment: the signal sent is drained below
        payload = error_payload(outcome.error) if outcome.error is not None else None
        spans, self._spans = self._spans, []
        rss = peak_rss()
        gathered = self.comm.allgather(
            (elapsed, payload, outcome.stats, outcome.notified, spans, self.wall_origin, rss)
        )
        self._drain_signals([g[3] for g in gathered])
        self._gather_timeline([g[4] for g in gathered])
        self.origins = [g[5] for g in gathered]
        self.peak_rss = max(self.peak_rss, *(g[6] for g in gathered))
        errors = [g[1] for g in gathered if g[1] is not None]
        result = StageResult(max(g[0] for g in gathered), [g[2] for g in gathered], bool(errors))
        if record is not None:
            record(result)
        if errors:
            raise error_from_payload(errors[0])
        return result

    def note(self, stage: str, started: float, ended: float | None = None) -> None:
        """A span of this rank's work in the timeline: ``stage`` from ``started`` to ``ended`` (now).

        Kept on this rank until the next agreement carries it to every rank.
        """
        end = self.clock() if ended is None else ended
        self._spans.append((stage, round(started - self.origin, 4), round(end - self.origin, 4)))

    def _gather_timeline(self, spans_by_rank: list[list[tuple[str, float, float]]]) -> None:
        """One timeline entry per stage the ranks noted since the last agreement, in the order
        they were first noted; each rank's start and end (None: that rank had no such span)."""
        entries: dict[tuple[str, int], TimelineEntry] = {}
        for rank, spans in enumerate(spans_by_rank):
            seen: dict[str, int] = {}
            for stage, start, end in spans:
                nth = seen[stage] = seen.get(stage, -1) + 1  # a stage noted twice: two entries
                entry = entries.setdefault(
                    (stage, nth), {"stage": stage, "start": [None] * self.size, "end": [None] * self.size}
                )
                entry["start"][rank], entry["end"][rank] = start, end
        self.timeline.extend(entries.values())

    def settle(self, between: Callable[[], None] | None = None) -> None:
        """Wait until every rank has arrived, napping instead of spinning a core.

        ``between`` runs between the naps; it must not block. A signal never ends the wait
        early: a rank that left would leave the others in a collective it never joins.

        MPI implementations busy-poll in blocking collectives. Ranks that wait long at an
        agreement (a node's non-leaders during the broadcast, everyone while rank 0 lists)
        would steal the CPU that the working ranks' writer threads need; a non-blocking
        barrier tested between short naps costs them nothing. The naps grow from 50 us to
        2 ms, so a short wait stays short.
        """
        request = self.comm.Ibarrier()
        nap_until(request.Test, SETTLE_NAP, MAX_SETTLE_NAP, between)

    # -- failure signal -------------------------------------------------------------------

    def signal_failure(self, outcome: StageOutcome[T]) -> None:
        """Tell every other rank, without blocking, that this rank has failed."""
        if outcome.notified or self.size == 1:
            return
        outcome.notified = True
        reqs = [self._signal_comm.isend(self.rank, dest=r, tag=_FAIL_TAG) for r in range(self.size) if r != self.rank]
        self._pending.extend(reqs)

    def peer_failed(self) -> bool:
        """Whether some other rank has signalled a failure, or this one got a signal (non-blocking)."""
        return self.interrupts.stopping or bool(self._signal_comm.iprobe(tag=_FAIL_TAG))

    def _drain_signals(self, notified: list[bool]) -> None:
        # Receive exactly the signals that were sent, so none is left in flight.
        for sender, sent in enumerate(notified):
            if sent and sender != self.rank:
                self._signal_comm.recv(source=sender, tag=_FAIL_TAG)
        for req in self._pending:
            req.wait()
        self._pending = []

    # -- small collectives ----------------------------------------------------------------

    def bcast_object(self, obj: T, root: int = 0) -> T:
        """Broadcast a small Python object (the others wait without spinning; see :meth:`settle`)."""
        self.settle()
        return self.comm.bcast(obj, root=root)

    def allgather(self, obj: T) -> list[T]:
        """Gather a small Python object from every rank onto every rank."""
        return list(self.comm.allgather(obj))
