"""When a rank sends its pulse, and when the rank it watches counts as stopped (pure).

MPI's launcher ends the job when a rank dies, but nothing notices a rank that stops: one
frozen by SIGSTOP, a debugger or a node that no longer schedules it leaves its peers waiting
on a posted receive (the chain after it) or in an agreement, for ever. So every rank sends a
small message, its pulse, to the next rank every :attr:`Pulse.interval` seconds, and watches
the pulse of the rank before it (:mod:`azcp_cluster.run.liveness` does the sending, on a thread
of its own, so a rank busy with its work still beats). A rank whose pulse has not come for
``timeout`` seconds has stopped, and the rank that watches it ends the job naming it.

The run's end is a pulse too: each rank sends a last one that says so, and waits for the one
from the rank before it, so no message is in flight when MPI ends. A rank that still beats is
waited for however long it takes to end; one that falls silent is named as ever.
"""

from __future__ import annotations

from dataclasses import dataclass

# Pulses per timeout: one late or lost to scheduling still leaves three.
PULSES_PER_TIMEOUT = 4
# The longest wait between two looks at the pulses (the watcher's tick).
MAX_TICK = 0.5


@dataclass
class Pulse:
    """One rank's pulse schedule and its watch over the rank before it (times from one clock)."""

    timeout: float
    started: float
    last_sent: float | None = None
    last_heard: float | None = None
    ending_since: float | None = None  # when this rank sent its last pulse
    heard_end: bool = False  # the rank before has sent its last pulse
    # The rank before named its own before as stopped and is ending the job: its silence that
    # follows is that ending, and the one line saying why is its (not this rank's) to say.
    named_before: bool = False
    last_look: float | None = None  # the watcher's last look (look)
    resumed_at: float | None = None  # when this rank last came back from standing still itself

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError("timeout must be positive")

    @property
    def interval(self) -> float:
        """Seconds between two pulses."""
        return self.timeout / PULSES_PER_TIMEOUT

    @property
    def tick(self) -> float:
        """Seconds between two looks (at most half an interval: a pulse is never sent late by more)."""
        return min(self.interval / 2, MAX_TICK)

    def send_due(self, now: float) -> bool:
        """Whether the next pulse is due (the first at once); never after the last one."""
        if self.ending_since is not None:
            return False
        return self.last_sent is None or now - self.last_sent >= self.interval

    def sent(self, now: float) -> None:
        """A pulse went out at ``now``."""
        self.last_sent = now

    def ending(self, now: float) -> None:
        """This rank sent its last pulse at ``now``."""
        self.ending_since = now

    def heard(self, now: float, last: bool, naming: bool = False) -> None:
        """The rank before's pulse came at ``now``; ``last``: its last one; ``naming``: it is ending the job."""
        self.last_heard = now
        self.heard_end = self.heard_end or last
        self.named_before = self.named_before or naming

    def look(self, now: float) -> None:
        """The watcher looks at ``now``. A gap since its last look of more than half the timeout
        (its looks are a tick apart) is this rank's own standing still: stopped (SIGSTOP, then the
        launcher's SIGCONT as it ends the job), a frozen VM, a starved host. The silence of the
        rank before over that gap says nothing of it, so its count starts again from now: a
        stopped rank that is woken never names a live one."""
        if self.last_look is not None and now - self.last_look > self.timeout / 2:
            self.resumed_at = now
        self.last_look = now

    def silent_for(self, now: float) -> float:
        """Seconds since the rank before was last heard (since the watch began, before its first
        pulse), or since this rank last came back from standing still, whichever is later."""
        since = self.last_heard if self.last_heard is not None else self.started
        if self.resumed_at is not None:
            since = max(since, self.resumed_at)
        return now - since

    def stopped(self, now: float) -> bool:
        """Whether the rank before counts as stopped: silent for the timeout (before its last
        pulse). One that still beats is alive, however long it takes to end (its last work
        may be long: writer threads draining, a slow filesystem)."""
        return not self.heard_end and self.silent_for(now) >= self.timeout

    def finished(self) -> bool:
        """Whether the watch is over: both ranks have sent their last pulse."""
        return self.ending_since is not None and self.heard_end


__all__ = ["MAX_TICK", "PULSES_PER_TIMEOUT", "Pulse"]
