"""Pacing downloads under a bandwidth cap. Pure code: the clock is passed in.

A storage account throttles a cluster that pulls faster than its egress limit with 503
ServerBusy, and the retries then make it worse. ``--max-bandwidth`` caps the aggregate; each
downloading rank paces its own share. The pacer is a virtual-clock token bucket (GCRA):
a request for ``n`` bytes may start once the bytes reserved before it, spread at ``rate``,
fit into the time elapsed plus one ``burst``. Requests are paced before they are sent, one
reservation per ranged GET, so the byte path itself carries no accounting.
"""

from __future__ import annotations

from collections.abc import Callable


class Pacer:
    """Spaces out reservations so that, from any start, bytes reserved <= rate x elapsed + burst."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        if rate <= 0 or burst < 0:
            raise ValueError("rate must be positive and burst non-negative")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._paid_until: float | None = None  # when the bytes reserved so far are paid for

    def reserve(self, nbytes: int) -> float:
        """Reserve ``nbytes`` now; return the seconds to wait before sending them."""
        now = self.clock()
        paid = now if self._paid_until is None else max(self._paid_until, now)
        self._paid_until = paid + nbytes / self.rate
        return max(0.0, self._paid_until - self.burst / self.rate - now)


def share(total_rate: float, downloaders: int) -> float:
    """One downloading rank's part of a cluster-wide cap."""
    if downloaders <= 0:
        raise ValueError("no downloaders")
    return total_rate / downloaders
