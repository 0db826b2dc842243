"""When to retry a request and how long to wait. Pure code (the random source is passed in)."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from email.utils import parsedate_to_datetime

from azcp_cluster.core.errors import printable

# 408 timeout, 429 throttled, and the 5xx that Azure documents as transient.
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})

# A body that brings fewer bytes than this a second, averaged over a --read-timeout of waiting
# for them, is a stalled body (retried, cause "slow body"): otherwise a trickle of a byte a
# second, never quiet for the read timeout, would hold a run for days. 4 KiB/s is far below
# any working share of a link (64 requests on a 10 Mbit/s link get 20 KB/s each), and a
# 16 MiB block at that pace would take over an hour. Time spent waiting for the pacer
# (--max-bandwidth), a buffer or the disk does not count: only time waiting for the server.
MIN_BODY_RATE = 4096

BASE_DELAY = 0.5  # the first retry's bound: a blip passes, a throttled service is not hammered
MAX_DELAY = 30.0  # the longest wait between tries: a run never sleeps through minutes
# After a retry notice, the next is said no sooner than this: a storm of 503s on 64 requests
# in flight is one line every few seconds, not a line per request.
NOTICE_EVERY = 5.0

# Told of each retry before its wait: (its number from 1, the limit, what is retried, why).
Notify = Callable[[int, int, str, str], None]


def backoff_delay(
    attempt: int,
    retry_after: float | None,
    rng: random.Random,
    base: float = BASE_DELAY,
    cap: float = MAX_DELAY,
) -> float:
    """Seconds to wait before retry number ``attempt`` (0 for the first retry).

    Exponential backoff with equal jitter (a delay drawn from the upper half of the
    current ceiling), so that many clients hit by the same 503 do not
    come back in lockstep; never shorter than the server's Retry-After, up to five times
    ``cap`` (a server that asks for longer is tried again after that: a run's retries stay bounded).
    """
    ceiling = min(cap, base * 2 ** min(attempt, 64))  # 2**1024 and up would not convert to float
    delay = rng.uniform(ceiling / 2, ceiling)
    if retry_after is not None:
        delay = max(delay, min(retry_after, 5 * cap))
    return delay


class Retries:
    """One request's retries: at most ``limit`` of them, each after :func:`backoff_delay`
    (``sleep`` is the caller's, ``asyncio.sleep`` in the package). The caller decides which
    failures retry and what it says on giving up; this only counts and waits.

    ``attempt`` is the number of retries made so far; :attr:`exhausted` once it is ``limit``.
    ``notify`` is told of each retry that :meth:`pause` is given the what and why of
    (:class:`RetryNotices`, or a download worker's message to its rank).
    """

    def __init__(
        self,
        limit: int,
        rng: random.Random,
        sleep: Callable[[float], Awaitable[object]],
        notify: Notify | None = None,
    ) -> None:
        self.limit, self.rng, self._sleep = limit, rng, sleep
        self.notify = notify
        self.attempt = 0

    @property
    def exhausted(self) -> bool:
        """Whether no retry is left: the next failure is the last."""
        return self.attempt >= self.limit

    async def pause(self, retry_after: float | None = None, what: str = "", cause: str = "") -> None:
        """Wait before the next try (the server's Retry-After honoured, see :func:`backoff_delay`);
        ``what`` is retried because of ``cause``, which ``notify`` is told first."""
        if self.notify is not None and what:
            self.notify(self.attempt + 1, self.limit, what, cause)
        await self._sleep(backoff_delay(self.attempt, retry_after, self.rng))
        self.attempt += 1


class RetryNotices:
    """A process's retries said on its console: the first at once, then at most one per
    ``every`` seconds (a storm is a line every few seconds), each saying how many went unsaid.

    ``say`` takes the one line (the console's); ``clock`` is monotonic seconds. Its
    :meth:`retrying` is a :data:`Notify`.
    """

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float], every: float = NOTICE_EVERY) -> None:
        self._say, self._clock, self.every = say, clock, every
        self.who = ""  # "rank 3": who retries, in each line
        self.count = 0  # retries told of since start()
        self._unsaid = 0  # of them, since the last line said
        self._last: float | None = None  # when the last line was said

    def start(self, who: str) -> None:
        """A new run in this process, by ``who``: nothing said yet."""
        self.who, self.count, self._unsaid, self._last = who, 0, 0, None

    def retrying(self, attempt: int, limit: int, what: str, cause: str) -> None:
        """Retry ``attempt`` of ``limit`` of ``what``, because of ``cause``: said, or counted for the next line."""
        self.count += 1
        now = self._clock()
        since = now - self._last if self._last is not None else None
        if since is not None and since < self.every:
            self._unsaid += 1
            return
        also = f" (and {self._unsaid} other retries in the last {since:.0f} s)" if self._unsaid and since else ""
        self._last, self._unsaid = now, 0
        who = f"{self.who}: " if self.who else ""
        line = f"azcp-cluster: notice: {who}retrying ({attempt}/{limit}) {what}: {cause}{also}"
        # A blob's name may hold any character: one line, whatever it holds.
        self._say(printable(line))


def too_slow(nbytes: int, seconds: float, floor: float = MIN_BODY_RATE) -> bool:
    """Whether ``nbytes`` received over ``seconds`` of waiting for a body is under the ``floor`` (bytes/s)."""
    return seconds > 0 and nbytes < floor * seconds


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # not '²' or other Unicode digits float() refuses
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - now)
