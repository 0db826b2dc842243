"""Many small system calls (stat, scandir) in threads, but only where each one waits.

A stat on a shared filesystem (NFS, Lustre, a FUSE mount) is a round trip to its servers,
tens to hundreds of microseconds: a million of them one after another is minutes, and
threads, which the GIL lets wait in the kernel together, divide that by their number. On a
warm local disk the same stat is 2 to 3 µs, mostly the interpreter's, and threads only add
their hand-offs: a 100,000-file walk took 1.7 s with 16 threads against 1.0 s in one (this
machine, 2 cores). So :class:`CallPool` runs the batches in the calling thread and times
them; once the calls it has made average :data:`SLOW_CALL` or more, it starts its threads
for the rest of its life. The results come back in the batches' order, and an error is that
of the first failing batch in that order, whatever the threads' timing.

What is timed is the calls' own time: the time the thread waited for a CPU meanwhile (Linux's
run-queue delay, :class:`RunQueue`) is left out. On a busy machine (two ranks and their
neighbours on two cores) a warm local stat could otherwise look slow, the sooner as a tree
of small directories gives small batches: three batches of a hundred names decide, and one
of them preempted for a few milliseconds makes the mean more than 20 µs (seen here, with
1,000 directories of 100, on the compare of a no-op rerun). Threads there only make the
walk and the compare slower, as above.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

THREADS = 16  # slow (network) stat calls in flight at once: a metadata server's queue, not a flood
# Mean seconds per call from which the calls go to threads: between a warm local stat
# (2-3 µs here) and a network filesystem's round trip (50 µs and more).
SLOW_CALL = 20e-6
# Calls timed before the mean is trusted.
CALIBRATE = 256


class RunQueue:
    """Seconds the calling thread has waited for a CPU so far (the second field of Linux's
    ``/proc/thread-self/schedstat``, in nanoseconds), read through one open file; 0.0 where
    there is none. A reading costs some 7 µs: :meth:`CallPool.map` reads it at its start and
    end, and after a batch only where the clock says the calls are slow."""

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1

    def __call__(self) -> float:
        if self._fd < 0:
            return 0.0
        try:
            return int(os.pread(self._fd, 256, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class CallPool:
    """Runs batches of system calls inline while they are fast, on threads once they are slow.

    ``clock`` times the batches; ``waited`` says how long the calling thread has waited for a
    CPU so far (default: a :class:`RunQueue` of the thread that calls :meth:`map`), which
    is not the calls' time.
    """

    def __init__(
        self,
        threads: int = THREADS,
        clock: Callable[[], float] = time.perf_counter,
        waited: Callable[[], float] | None = None,
    ) -> None:
        self._threads = threads
        self._clock = clock
        self._waited = waited
        self._pool: ThreadPoolExecutor | None = None
        self._calls = 0
        self._seconds = 0.0  # the batches' time, run-queue delay included
        self._waited_for = 0.0  # the run-queue delay counted in it so far (read where needed)

    @property
    def threaded(self) -> bool:
        """Whether the calls have been found slow (and go to threads from now on)."""
        return self._pool is not None

    def map(self, fn: Callable[[T], R], batches: Sequence[T], calls: Callable[[R], int]) -> list[R]:
        """``fn`` of each batch, in order; ``calls`` says how many system calls a result took."""
        results: list[R] = []
        at = 0
        queue = RunQueue() if self._waited is None and self._pool is None and batches else None
        waited = self._waited or queue or (lambda: 0.0)
        # The batches run back to back: one clock reading between two ends the first's time
        # and starts the next's. The run queue is read at the start, the end, and where the
        # clock alone says slow (a few microseconds a reading: not once per tiny batch).
        started = self._clock()
        waited_start = waited()
        try:
            while at < len(batches) and self._pool is None:
                result = fn(batches[at])
                now = self._clock()
                self._seconds += now - started
                started = now
                self._calls += calls(result)
                results.append(result)
                at += 1
                if self._calls >= CALIBRATE and self._seconds - self._waited_for >= SLOW_CALL * self._calls:
                    now_waited = waited()
                    self._waited_for += now_waited - waited_start
                    waited_start = now_waited
                    if self._seconds - self._waited_for >= SLOW_CALL * self._calls:
                        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="azcp-syscalls")
        finally:
            if self._pool is None:
                self._waited_for += waited() - waited_start  # up to the end of this call's batches
            if queue is not None:
                queue.close()
        if at < len(batches):
            assert self._pool is not None
            futures = [self._pool.submit(fn, batch) for batch in batches[at:]]
            try:
                results.extend(future.result() for future in futures)
            finally:
                for future in futures:  # after an error: what has not started never starts
                    future.cancel()
        return results

    def close(self) -> None:
        """Stop the threads (waiting for the calls under way)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> CallPool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
