"""Pacing downloads under a bandwidth cap. Pure code: the clock is passed in.

A storage account throttles a cluster that pulls faster than its egress limit with 503
ServerBusy, and the retries then make it worse. ``--max-bandwidth`` caps the aggregate; each
downloading rank (or each of its download worker processes) paces its own share with a
:class:`Pacer`, a virtual-clock token bucket (GCRA) whose burst is :data:`BURST_SECONDS` of
its rate, whatever the block size.

Each ranged GET books a :class:`Booking`: its bytes get the next ``length / rate`` seconds of the
pacer's timeline, right after the bytes booked before them (or from now, when the timeline
has fallen behind the clock: idle time earns no credit beyond the burst). Its bytes are then
taken a piece at a time as they are due: byte ``u`` of a booking may be read once the clock is
past ``booking.start + (u - burst) / rate``. The request is sent when its first piece is due, so
the server is asked for a block only about when its bytes are wanted (concurrent requests
follow each other along the timeline instead of all starting at once), and a block larger
than the burst is paid for as it is read, not all at once, before or after (but for a pacer
slower than :data:`MIN_BODY_RATE`, which pays for each block before its request).

What that guarantees, from any moment a booking was made on (``test_throttle.py`` checks
both): the bytes of that booking and the later ones that are due by time ``t`` are at most
``rate x elapsed + burst``; and when each piece is read as soon as it is due, the bytes read
within any interval of ``d`` seconds are at most ``rate x d + burst`` (a piece is never larger
than the burst). With a burst of 0.1 s of the rate, any window of 2 s or more stays within
5 % of the cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The burst, in seconds of the rate: what a pacer may take at once, and the largest piece
# read between two waits. A block's worth (the old burst) let a copy shorter than a few
# blocks finish at line rate; 0.1 s bounds the overshoot by 0.1 s over the whole copy and
# costs at most ten waits a second.
BURST_SECONDS = 0.1
# Azure allows a GET two minutes per MiB (8.7 KB/s) and cuts off a slower one. A pacer slower
# than twice that (a small cap split over many ranks) cannot read a body at its own rate: it
# reads each block whole once all of it is paid for, as a burst of one block did.
MIN_BODY_RATE = 16 * 1024
WHOLE = 1 << 62  # a piece no block reaches


@dataclass(frozen=True)
class Booking:
    """One ranged GET's place on a pacer's timeline: its first byte is paid at ``start``. (Not
    a *slot*: in this package a slot is the fan-out's buffer, ``fanout.slot.Slot``.)"""

    start: float
    length: int


class Pacer:
    """Books ranged GETs onto a timeline at ``rate`` and says when each piece of them is due."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        if rate <= 0 or burst < 0:
            raise ValueError("rate must be positive and burst non-negative")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._paid_until: float | None = None  # when the bytes booked so far are paid for

    @classmethod
    def for_rate(cls, rate: float, clock: Callable[[], float]) -> Pacer:
        """A pacer at ``rate`` bytes per second with a burst of :data:`BURST_SECONDS` of it."""
        return cls(rate, BURST_SECONDS * rate, clock)

    @property
    def piece(self) -> int:
        """The most bytes to read between two waits: the burst (at least one byte); below
        :data:`MIN_BODY_RATE`, a whole block."""
        return max(1, int(self.burst)) if self.rate >= MIN_BODY_RATE else WHOLE

    def book(self, nbytes: int) -> Booking:
        """Give the next ``nbytes`` of the timeline to one request (a retry books again: it pays again)."""
        now = self.clock()
        start = now if self._paid_until is None else max(self._paid_until, now)
        self._paid_until = start + nbytes / self.rate
        return Booking(start, nbytes)

    def delay(self, booking: Booking, upto: int) -> float:
        """Seconds to wait before the first ``upto`` bytes of ``booking`` may be taken (0 if already due)."""
        return max(0.0, booking.start + (upto - self.burst) / self.rate - self.clock())


def share(total_rate: float, downloaders: int) -> float:
    """One downloading rank's part of a cluster-wide cap."""
    if downloaders <= 0:
        raise ValueError("no downloaders")
    return total_rate / downloaders
