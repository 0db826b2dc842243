"""The stall watchdog's view of one response body: silent for --read-timeout (a stall), or too
slow over it (a trickle: core.retry.MIN_BODY_RATE). The downloader looks at every body in
flight once a tick (downloader._watch_peers); a body given up on is aborted, its read fails,
and its block is asked again with the cause said here.
"""

from __future__ import annotations

from azcp_cluster.core.retry import too_slow
from azcp_cluster.download.http1 import Connection


class BodyWatch:
    """Progress of one response body, for the stall watchdog."""

    __slots__ = ("cause", "conn", "idle", "seen", "stalled", "window", "window_bytes")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.seen = conn.received
        self.idle = 0.0
        self.stalled = False
        self.cause = "timeout"  # why it was given up on: quiet ("timeout") or too slow ("slow body")
        self.window = 0.0  # seconds spent waiting for the server since the last look at its pace
        self.window_bytes = 0  # bytes received in them

    def look(self, tick: float, read_timeout: float) -> None:
        """One look, ``tick`` seconds after the last: abort the connection of a body silent for
        ``read_timeout`` of waiting for the server, or too slow over that long."""
        received = self.conn.received
        if not self.conn.awaiting_body:  # waiting for a buffer or the disk: not a stall
            self.seen, self.idle = received, 0.0
            return
        self.window += tick
        self.window_bytes += received - self.seen
        if received != self.seen:
            self.seen, self.idle = received, 0.0
        else:
            # Bytes under the socket's low-water mark are not seen: from the first quiet tick
            # on, this body's bytes are taken as they come (a slow server is not a stalled one).
            self.conn.trickle()
            self.idle += tick
        if self.stalled:
            return
        if self.idle >= read_timeout:
            self.stalled = True
            self.conn.abort()  # the pending read fails and the block is retried
        elif self.window >= read_timeout:
            # A trickle is never quiet for the read timeout: its pace is looked at instead.
            if too_slow(self.window_bytes, self.window):
                # Quiet for most of it: a stall after a few bytes, not a trickle.
                self.cause = "timeout" if self.idle >= self.window / 2 else "slow body"
                self.stalled = True
                self.conn.abort()
            self.window, self.window_bytes = 0.0, 0


__all__ = ["BodyWatch"]
