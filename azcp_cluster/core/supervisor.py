"""The supervision of one rank's download workers, as a state machine without I/O. Pure code.

The driver (:class:`azcp_cluster.download.workers.WorkerDownloader`) owns the processes, their
sockets and the rank's token cache; it tells :class:`Supervisor` what happened (a worker said
something, a worker's socket closed, a tick passed, another rank failed, the token cache
answered) and carries out the instructions it gets back (tell workers to stop, kill one, send
them a token, stop listening to one, ask the cache, done). Everything that decides when the
workers stop, who is killed and why, and what the run's error is lives here, tested in
process without a process.

Rules:

* A worker is *live* until it said its last (``done``, ``error``, ``stopped``, or anything
  the rank does not understand), its socket closed, or it was killed after the grace.
* Any worker's failure (an error, a stop, a death, a silence) or another rank's starts the
  *stop*: once, and the grace (:data:`STOP_GRACE_SECONDS`) runs from then. At each tick
  while stopping, the live workers not yet told are told to stop (each once: a worker that
  does not read must not fill its socket), and once the grace is over every live worker is
  killed and waited for.
* A live worker that said nothing (not even that it is alive) for longer than the silence
  limit is named, killed, and starts the stop; during a stop silence is not judged.
* While not stopping, each tick asks the token cache (:class:`Refresh`); a token that
  differs from the last one sent goes to every live worker.
* :class:`Done` is given once, when no worker is live; it carries the error of the lowest
  worker whose failure was its own (a worker told to stop is not one), or says that every
  failure was a stop (the rank then raises PeerFailed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from azcp_cluster.core.errors import AzcpError, DownloadError, InternalError

# How long stopped workers get to end on their own before they are killed.
STOP_GRACE_SECONDS = 10.0
# The messages that say the worker goes on (the driver passes their bytes on); any other is its last.
ALIVE_WORDS = frozenset({"alive", "bytes", "landed", "retrying"})


class Stopped(AzcpError):
    """A worker that stopped because it was told to (another failure is the one to report)."""


# -- events ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Said:
    """Worker ``worker`` sent a message of ``kind`` at ``at``; ``error``: the error it sent (kind ``error``)."""

    worker: int
    kind: str
    at: float
    error: AzcpError | None = None


@dataclass(frozen=True)
class Ended:
    """Worker ``worker``'s socket closed before its last word; it exited with ``code`` (seen at ``at``)."""

    worker: int
    code: int
    at: float


@dataclass(frozen=True)
class Tick:
    """A turn of the driver's loop ended at ``at`` (after the messages it read)."""

    at: float


@dataclass(frozen=True)
class PeerFailure:
    """Another rank failed (seen at ``at``)."""

    at: float


@dataclass(frozen=True)
class Token:
    """The token cache's answer to :class:`Refresh`: the rank's bearer token and its expiry now."""

    value: tuple[str, float]


Event = Said | Ended | Tick | PeerFailure | Token


# -- instructions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tell:
    """Tell ``workers`` to stop (``("stop",)`` on their sockets; a failed send is their end's to say)."""

    workers: tuple[int, ...]


@dataclass(frozen=True)
class SendToken:
    """Send ``token`` (``("token", token)``) to ``workers``."""

    workers: tuple[int, ...]
    token: tuple[str, float]


@dataclass(frozen=True)
class Kill:
    """Kill ``worker``'s process; ``wait``: and wait for it (else its socket's close says it ended)."""

    worker: int
    wait: bool


@dataclass(frozen=True)
class Drop:
    """Stop listening to ``worker`` (it said its last, or ended)."""

    worker: int


@dataclass(frozen=True)
class Refresh:
    """Ask the token cache for the token now (it refreshes one that is due); answer with :class:`Token`."""


@dataclass(frozen=True)
class Done:
    """Every worker ended: raise ``error`` if set, else PeerFailed if ``stopped``, else the run succeeded."""

    error: AzcpError | None
    stopped: bool


Instruction = Tell | SendToken | Kill | Drop | Refresh | Done


@dataclass
class _Seat:
    """What the supervisor knows of one worker."""

    pid: int
    heard: float  # when it last said anything (started: when it was started)
    live: bool = True
    told: bool = False  # told to stop
    error: AzcpError | None = None


class Supervisor:
    """One rank's download workers (see the module). Feed it events; carry out what they return.

    ``pids`` and ``started``: each worker's process id (named in errors) and when it was
    started (its silence counts from then). ``silence``: how long a worker may say nothing.
    ``token``: the token the workers were started with, or None where the rank's credential
    has no tokens (then nothing is ever refreshed).
    """

    def __init__(
        self,
        pids: Sequence[int],
        started: Sequence[float],
        silence: float,
        *,
        token: tuple[str, float] | None = None,
        grace: float = STOP_GRACE_SECONDS,
    ) -> None:
        self.seats = [_Seat(pid, at) for pid, at in zip(pids, started, strict=True)]
        self.silence = silence
        self.grace = grace
        self.token = token  # the last token the workers were given
        self.stop_by: float | None = None  # once stopping: when the grace ends
        self._finished = False

    # -- events -----------------------------------------------------------------------------

    def start(self) -> list[Instruction]:
        """The first instructions: :class:`Done` at once when there is no worker."""
        return self._finish_if_over([])

    def feed(self, event: Event) -> list[Instruction]:
        """Tell the machine what happened; what the driver is to do now, in order."""
        if self._finished:
            return []  # nothing is left to decide (the driver stopped at Done)
        if isinstance(event, Said):
            return self._said(event)
        if isinstance(event, Ended):
            return self._ended(event)
        if isinstance(event, Tick):
            return self._tick(event.at)
        if isinstance(event, PeerFailure):
            self._stop(event.at)
            return []
        return self._token(event.value)

    # -- queries ----------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """Whether the stop began (a failure here or another rank's)."""
        return self.stop_by is not None

    @property
    def finished(self) -> bool:
        """Whether :class:`Done` was given."""
        return self._finished

    def live(self) -> tuple[int, ...]:
        """The workers still live, in order."""
        return tuple(i for i, seat in enumerate(self.seats) if seat.live)

    # -- internals --------------------------------------------------------------------------

    def _said(self, event: Said) -> list[Instruction]:
        seat = self.seats[event.worker]
        if not seat.live:
            return []  # (the driver no longer listens to it)
        seat.heard = event.at
        if event.kind in ALIVE_WORDS:
            return []
        # Its own last word is its reason, also when it was killed for its silence meanwhile
        # (a close, in _ended, keeps that reason).
        if event.kind == "error":
            seat.error = event.error or InternalError(f"download worker {event.worker} sent an error without one")
        elif event.kind == "stopped":
            seat.error = Stopped(f"download worker {event.worker} stopped")
        elif event.kind != "done":
            seat.error = InternalError(f"download worker {event.worker} sent {event.kind!r}")
        return self._gone(event.worker, event.at)

    def _ended(self, event: Ended) -> list[Instruction]:
        """Its socket closed before its last word: it died (or stopped, when told to)."""
        seat = self.seats[event.worker]
        if not seat.live:
            return []
        seat.heard = event.at
        if seat.error is None:  # else it already has its reason (killed for its silence)
            if self.stopping:  # a signal to the group, or another failure: that is the one to report
                seat.error = Stopped(f"download worker {event.worker} ended (exit code {event.code})")
            else:
                seat.error = DownloadError(
                    f"download worker {event.worker} (pid {seat.pid}) ended without finishing (exit code {event.code})"
                )
        return self._gone(event.worker, event.at)

    def _gone(self, worker: int, at: float) -> list[Instruction]:
        """``worker`` said its last or ended: no longer listened to; its failure stops the others."""
        seat = self.seats[worker]
        seat.live = False
        if seat.error is not None:
            self._stop(at)
        return [Drop(worker)]

    def _stop(self, at: float) -> None:
        """Begin the stop (once): the grace runs from ``at``."""
        if self.stop_by is None:
            self.stop_by = at + self.grace

    def _tick(self, at: float) -> list[Instruction]:
        """The policy, once a turn: silence, then the stop's telling and killing, or the token."""
        out: list[Instruction] = []
        if self.live():
            if not self.stopping:
                self._judge_silence(at, out)
            if self.stopping:
                self._press(at, out)
            elif self.token is not None:  # (a credential without tokens: nothing to refresh)
                out.append(Refresh())
        return self._finish_if_over(out)

    def _judge_silence(self, at: float, out: list[Instruction]) -> None:
        """The first live worker silent for longer than the limit is named, killed, and stops the rest."""
        silent = next((i for i in self.live() if at - self.seats[i].heard > self.silence), None)
        if silent is None:
            return
        seat = self.seats[silent]
        seat.error = DownloadError(
            f"download worker {silent} (pid {seat.pid}) said nothing for "
            f"{at - seat.heard:.0f} s (frozen, or stuck starting); stopped it"
        )
        out.append(Kill(silent, wait=False))
        self._stop(at)

    def _press(self, at: float, out: list[Instruction]) -> None:
        """Stopping: tell the live workers not yet told; past the grace, kill every live one."""
        untold = tuple(i for i in self.live() if not self.seats[i].told)
        for index in untold:
            self.seats[index].told = True
        if untold:
            out.append(Tell(untold))
        assert self.stop_by is not None
        if at < self.stop_by:
            return
        for index in self.live():  # told, and still there: not waited for longer
            seat = self.seats[index]
            seat.error = seat.error or Stopped(f"download worker {index} killed")
            seat.live = False
            out += [Kill(index, wait=True), Drop(index)]

    def _token(self, token: tuple[str, float]) -> list[Instruction]:
        """The cache's token: sent to every live worker when it changed (never while stopping)."""
        if self.stopping or token == self.token:
            return []
        self.token = token
        live = self.live()
        return [SendToken(live, token)] if live else []

    def _finish_if_over(self, out: list[Instruction]) -> list[Instruction]:
        """``out``, and :class:`Done` once no worker is live (given once)."""
        if self._finished or self.live():
            return out
        self._finished = True
        errors = [seat.error for seat in self.seats if seat.error is not None]
        own = [error for error in errors if not isinstance(error, Stopped)]
        out.append(Done(own[0] if own else None, bool(errors) and not own))
        return out
