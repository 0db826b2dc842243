"""Progress on rank 0's stderr: a one-line bar on a terminal, plain status lines anywhere else.

``--progress auto`` (the default) draws the bar when stderr is a terminal and, when it is not
(``mpiexec`` and ``srun`` pipe it; a Slurm log is a file), prints a status line every
:data:`LINE_SECONDS` or each :data:`LINE_STEP` of the stage, whichever comes first, so that
``tail -f`` on a job's log shows a long stage moving (or stalled: the line still comes, with
its rate). One :class:`Progress` per stage.

One measure makes the percent, the bytes, the rate and the ETA alike: the bytes of file data
the fan-out has landed on rank 0's node, of all it carries there (with several rails, rank 0's
rail). The chain brings every transfer to every node within a few pieces of each other, so
this is where the cluster stands; no count of one rank's own download is mixed in (it ran ahead
of the fan-out and read as a different copy). The ETA waits for a steady rate (:func:`steady_rate`).
The files count those of the listing complete on rank 0's node, already present ones included,
of every file ``[list]`` counted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TextIO

from azcp_cluster.core.config import PROGRESS_MODES as MODES
from azcp_cluster.core.config import format_bytes

__all__ = ["BAR_NEEDS_A_TERMINAL", "MODES", "Progress", "resolve_mode", "steady_rate", "terminal_width"]
# Status lines (not a terminal): one at least this often while the stage runs, and one each
# time the stage has moved on by this fraction (but not more than one a second).
LINE_SECONDS = 10.0  # a log shows the run alive at least this often
LINE_STEP = 0.05  # twenty lines for a stage that moves steadily
LINE_MIN_SECONDS = 1.0  # a fast stage does not flood a log
BAR_HZ = 4.0  # redraws a second: smooth to the eye, cheap for the rank
_CLEAR = "\x1b[K"  # erase to the end of the line: a shorter redraw leaves nothing behind
# The ETA: only after this many seconds of bytes moving (a first transfer's rate over a few
# milliseconds promised 35 hours), and only while the rate over the last half of the window
# is within STEADY of the window's (a stall or a burst makes no promise).
ETA_AFTER = 2.0
ETA_WINDOW = 10.0  # the rate shown and the ETA's: over the last this many seconds
STEADY = 0.5
# What --progress bar says once where stderr is not a terminal, before it prints lines instead.
BAR_NEEDS_A_TERMINAL = "azcp-cluster: --progress bar needs a terminal on stderr; showing status lines instead"


def resolve_mode(requested: str, rank: int, stream: TextIO | None = None) -> str:
    """What this rank shows: ``bar``, ``lines`` or ``none`` (only rank 0 shows anything).

    ``auto``: the bar on a terminal, lines otherwise. ``bar`` asked for where stderr is not a
    terminal prints lines instead (a bar's carriage returns are noise in a file); the caller
    says so (:data:`BAR_NEEDS_A_TERMINAL`).
    """
    stream = stream or sys.stderr
    if rank != 0 or requested == "none":
        return "none"
    tty = hasattr(stream, "isatty") and stream.isatty()
    if requested == "lines" or not tty:
        return "lines"
    return "bar"


def terminal_width(stream: TextIO, fallback: int = 80) -> int:
    """Columns of the terminal behind ``stream`` (COLUMNS first, as shells and tmux set it)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(stream.fileno()).columns or fallback
    except (OSError, ValueError, AttributeError):
        return shutil.get_terminal_size((fallback, 24)).columns


def steady_rate(samples: Sequence[tuple[float, int]], now: float, done: int) -> float | None:
    """Bytes a second over the last :data:`ETA_WINDOW` seconds, if it is steady enough to
    promise an ETA: at least :data:`ETA_AFTER` seconds since the first bytes moved, and the
    rate over the window's last half within :data:`STEADY` of the window's. ``samples``: (time,
    bytes done) as they moved, the first with bytes done at its start (the stage's)."""
    moving = next((t for t, d in samples if d > 0), None)
    if moving is None or now - moving < ETA_AFTER:
        return None
    begin = max(moving, now - ETA_WINDOW)
    t0, d0 = _at(samples, begin)
    tm, dm = _at(samples, (t0 + now) / 2)
    if now - t0 <= 0 or now - tm <= 0:
        return None
    window, half = (done - d0) / (now - t0), (done - dm) / (now - tm)
    if window <= 0 or abs(half - window) > STEADY * window:
        return None
    return window


def _at(samples: Sequence[tuple[float, int]], when: float) -> tuple[float, int]:
    """The last sample taken at or before ``when`` (the first one if none was)."""
    found = samples[0]
    for sample in samples:
        if sample[0] > when:
            break
        found = sample
    return found


class Progress:
    """Counts a stage's bytes toward a total and shows them (``mode``: bar, lines or none).

    ``add`` is called by the stage's thread and the lines' ticker draws too: one of them draws
    at a time (the ticker reads the samples as a snapshot). ``close`` ends the stage's output cleanly.
    """

    def __init__(
        self,
        label: str,
        total: int,
        mode: str,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        width: int | None = None,
    ) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.mode = mode if total > 0 and mode in ("bar", "lines") else "none"
        self.clock = clock
        self.started = clock()
        self.last = 0.0  # when the last bar or line was drawn (0: never)
        self.last_fraction = 0.0  # lines: the fraction the last line showed
        self.files_total = 0
        self.files_done = 0
        # (time, bytes done) as they moved, for the rate and the ETA (steady_rate): the window's
        # and one before it.
        self.samples: deque[tuple[float, int]] = deque([(self.started, 0)])
        self._width = width
        self._drawing = threading.Lock()
        self._closed = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.mode == "lines":
            # A stalled stage adds nothing: the ticker still says so every LINE_SECONDS.
            self._ticker = threading.Thread(target=self._tick_lines, name="azcp-progress", daemon=True)
            self._ticker.start()

    @property
    def enabled(self) -> bool:
        """Whether anything is shown."""
        return self.mode != "none"

    def expect_files(self, total: int, present: int = 0) -> None:
        """Also show how many of ``total`` files (the listing's) are complete, ``present`` of them
        before the stage starts (already in DEST, empty, or carried by another rail)."""
        self.files_total = total
        self.files_done = present

    def add(self, n: int, files: int = 0) -> None:
        """Account ``n`` more bytes (and ``files`` more files complete) and show them if it is time."""
        self.done += n
        self.files_done += files
        now = self.clock()
        if n:
            self._sample(now)
        self._tick(now)

    def _sample(self, now: float) -> None:
        samples = self.samples
        samples.append((now, self.done))
        # Keep one sample older than the window: the window's rate starts from it.
        while len(samples) > 2 and samples[1][0] < now - ETA_WINDOW:
            samples.popleft()

    def fraction(self) -> float:
        """How much of the stage is done: its bytes over its total."""
        return min(1.0, self.done / self.total) if self.total else 1.0

    def rate(self, now: float) -> float:
        """Bytes a second: the steady rate of the last seconds, else the stage's average so far."""
        steady = steady_rate(tuple(self.samples), now, self.done)
        if steady is not None:
            return steady
        return self.done / max(now - self.started, 1e-6)

    def eta(self, now: float) -> float | None:
        """Seconds left at the steady rate (None until it is steady, and at the end)."""
        if self.done >= self.total:
            return None
        steady = steady_rate(tuple(self.samples), now, self.done)
        return (self.total - self.done) / steady if steady else None

    def _tick(self, now: float) -> None:
        if self.mode == "none":
            return
        if self.mode == "bar":
            if now - self.last < 1.0 / BAR_HZ:
                return
        elif not self._line_due(now):
            return
        self._draw(now)

    def _line_due(self, now: float) -> bool:
        since = now - (self.last or self.started)
        if since >= LINE_SECONDS:
            return True
        return since >= LINE_MIN_SECONDS and self.fraction() - self.last_fraction >= LINE_STEP

    def _tick_lines(self) -> None:
        while not self._closed.wait(LINE_SECONDS / 4):
            if self._line_due(self.clock()):
                self._draw(self.clock())

    def _draw(self, now: float, final: bool = False) -> None:
        # The stage's thread and the ticker: one draws.
        if not self._drawing.acquire(blocking=final):
            return
        try:
            if self.mode == "none" or (self._closed.is_set() and not final):
                return
            self.last = now
            self.last_fraction = self.fraction()
            text = "\r" + self.bar(now) + _CLEAR if self.mode == "bar" else self.status(now) + "\n"
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.mode = "none"  # a terminal or a pipe gone (EIO, EPIPE) ends the progress, never the copy
        finally:
            self._drawing.release()

    def _parts(self, now: float) -> list[tuple[int, str]]:
        """What a line says, in the order it says it, each with its rank (0: always shown; a
        narrow terminal drops the highest first). The bar and the lines say the same."""
        done = self.done
        eta = self.eta(now)
        parts = [
            (0, f"{self.fraction() * 100:5.1f}%"),
            (2, f"{format_bytes(done)} / {format_bytes(self.total)}"),
            (3, f"{format_bytes(self.rate(now))}/s"),
            (1, f"ETA {_duration(eta)}" if eta is not None else ""),
        ]
        if self.files_total:
            parts.append((4, f"{self.files_done}/{self.files_total} file{'' if self.files_total == 1 else 's'}"))
        return [(rank, text) for rank, text in parts if text]

    @staticmethod
    def _join(parts: list[tuple[int, str]]) -> str:
        return parts[0][1] + "".join(f", {text}" for _, text in parts[1:])

    def status(self, now: float) -> str:
        """One status line (not a terminal): ``[progress] <stage> <percent>, ...``."""
        return f"[progress] {self.label} {self._join(self._parts(now))}"

    def bar(self, now: float) -> str:
        """The bar as drawn at ``now``, within the terminal's width (one column spare). Where it is
        narrow, the files' count goes first, then the bar (10 to 30 cells),
        then the rest, least useful first."""
        width = (self._width or terminal_width(self.stream)) - 1
        parts = self._parts(now)
        label = f"{self.label} "
        while len(label) + len(self._join(parts)) + 13 > width and max(parts)[0] >= 4:
            parts.remove(max(parts))
        while len(label) + len(self._join(parts)) > width and len(parts) > 1:
            parts.remove(max(parts))
        text = self._join(parts)
        cells = min(30, width - len(label) - len(text) - 3)  # "[", "] "
        if cells >= 5:
            filled = int(self.fraction() * cells)
            label += f"[{'#' * filled}{'.' * (cells - filled)}] "
        return (label + text)[:width]

    def close(self) -> None:
        """End the stage's output: the bar redrawn at its end (no stale ETA) and its line ended;
        with lines, a last line if the stage moved since the one before."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.mode == "bar" and self.last:
            self._draw(self.clock(), final=True)
            with contextlib.suppress(OSError, ValueError):
                self.stream.write("\n")
                self.stream.flush()
        elif self.mode == "lines" and self.last and self.fraction() > self.last_fraction:
            self._draw(self.clock(), final=True)


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
