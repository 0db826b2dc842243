"""A one-line progress bar on rank 0's terminal (stderr), redrawn a few times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from azcp_cluster.config import format_bytes


class Progress:
    """Counts bytes toward a total and redraws at most ``hz`` times a second."""

    def __init__(self, label: str, total: int, enabled: bool, stream: TextIO | None = None, hz: float = 4) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.interval = 1.0 / hz
        self.started = time.monotonic()
        self.last = 0.0

    def add(self, n: int) -> None:
        """Account ``n`` more bytes and redraw if it is time."""
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.interval or self.done >= self.total):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total)
        width = 30
        filled = int(frac * width)
        rate = self.done / max(now - self.started, 1e-6)
        self.stream.write(
            f"\r{self.label:9s} [{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}% "
            f"{format_bytes(self.done)} / {format_bytes(self.total)} {format_bytes(rate)}/s "
        )
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled and self.last:
            self.stream.write("\n")
            self.stream.flush()


def wants_progress(requested: bool, rank: int, stream: TextIO | None = None) -> bool:
    """A bar only on rank 0, only when asked and only on a terminal."""
    stream = stream or sys.stderr
    return requested and rank == 0 and hasattr(stream, "isatty") and stream.isatty()
