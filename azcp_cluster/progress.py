"""A one-line progress bar on rank 0's terminal (stderr), redrawn a few times a second.

One bar per stage. The streaming stage's bar shows both halves: the bytes fanned out of the
total (the bar, the rate and the ETA follow these: every byte reaches every node through
them), this node's downloaded bytes of its share, and the files complete.
"""

from __future__ import annotations

import contextlib
import sys
import threading
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
        self.download_total = 0  # streaming: this node's share of the download
        self.downloaded = 0
        self.files_total = 0
        self.files_done = 0
        self._drawing = threading.Lock()

    def expect_download(self, total: int) -> None:
        """Streaming: also show ``total`` bytes this rank downloads."""
        self.download_total = total

    def expect_files(self, total: int) -> None:
        """Also show how many of ``total`` files are complete."""
        self.files_total = total

    def add(self, n: int, files: int = 0) -> None:
        """Account ``n`` more bytes (and ``files`` more files complete) and redraw if it is time."""
        self.done += n
        self.files_done += files
        self._tick()

    def add_download(self, n: int) -> None:
        """Streaming: account ``n`` more bytes downloaded by this rank."""
        self.downloaded += n
        self._tick()

    def _tick(self) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.interval and self.done < self.total):
            return
        # Two threads add while streaming (the download's and the fan-out's): one draws.
        if not self._drawing.acquire(blocking=False):
            return
        try:
            self.last = now
            self.stream.write("\r" + self.line(now))
            self.stream.flush()
        except OSError:
            self.enabled = False  # a terminal gone (EIO, EPIPE) ends the bar, never the copy
        finally:
            self._drawing.release()

    def line(self, now: float) -> str:
        """The bar as drawn at ``now`` (monotonic seconds)."""
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        width = 30
        filled = int(frac * width)
        elapsed = max(now - self.started, 1e-6)
        rate = self.done / elapsed
        text = (
            f"{self.label:9s} [{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}% "
            f"{format_bytes(self.done)} / {format_bytes(self.total)} {format_bytes(rate)}/s"
        )
        if self.download_total:
            text += f", downloaded here {format_bytes(self.downloaded)} / {format_bytes(self.download_total)}"
        if self.files_total:
            text += f", {self.files_done}/{self.files_total} files"
        if 0 < frac < 1 and rate > 0:
            text += f", ETA {(self.total - self.done) / rate:.0f}s"
        return text + " "

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled and self.last:
            with contextlib.suppress(OSError):
                self.stream.write("\n")
                self.stream.flush()


def wants_progress(requested: bool, rank: int, stream: TextIO | None = None) -> bool:
    """A bar only on rank 0, only when asked and only on a terminal."""
    stream = stream or sys.stderr
    return requested and rank == 0 and hasattr(stream, "isatty") and stream.isatty()
