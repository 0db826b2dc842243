"""Growing naps: how a rank waits for MPI (or a thread) without spinning a core. Pure code
(the sleep is passed in).

MPI moves a request only inside MPI calls, so a wait tests it often at first; one that lasts
(a peer still downloading, a lister still listing) should cost the working ranks no CPU. So
every such wait naps ``first`` seconds, then twice as long each time nothing happened, up to
``cap``: a short wait stays short, a long one is a few hundred looks a second at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Naps:
    """Naps of ``first`` seconds, doubling after each, up to ``cap``; :meth:`reset` starts
    again from ``first`` (something happened: the next look should come soon)."""

    def __init__(self, first: float, cap: float, sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0 < first <= cap:
            raise ValueError("naps need 0 < first <= cap")
        self.first, self.cap, self._sleep = first, cap, sleep
        self.next = first  # the length of the next nap

    def nap(self, instead: float | None = None) -> None:
        """Sleep the next nap (or ``instead`` seconds: a wait with nothing in flight), and make
        the one after it twice as long, up to the cap."""
        self._sleep(self.next if instead is None else instead)
        self.next = min(self.next * 2, self.cap)

    def reset(self) -> None:
        """The next nap back to ``first``."""
        self.next = self.first


def nap_until(
    done: Callable[[], bool],
    first: float,
    cap: float,
    between: Callable[[], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Test ``done`` until it holds, napping (:class:`Naps`) after each test that fails;
    ``between`` (which must not block) runs once after each such test, before the nap."""
    naps = Naps(first, cap, sleep)
    while not done():
        if between is not None:
            between()
        naps.nap()


__all__ = ["Naps", "nap_until"]
