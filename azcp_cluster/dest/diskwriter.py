"""The disk-writer service: the node writer's threads (nodewriter.py), for the download and the fan-out alike.

Writes are positional and synchronous (O_DIRECT, or buffered for small files); the GIL is
released inside them, so a few threads keep several in flight while the event loop (the
download) and the MPI thread (the fan-out) go on. When both stages run at once (streaming),
a leader that downloads and fans out has one pool, sized for both, instead of two that
would compete for the same disk and cores.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

from azcp_cluster.run.interrupts import shield

Job = tuple[Callable[[], object], Callable[[BaseException | None], None]]


class DiskWriter:
    """``threads`` writer threads fed through one queue, in submission order.

    ``submit(work, done)``: ``work()`` runs on a writer thread; ``done(error)`` runs right
    after it on the same thread, with the exception ``work`` raised or None. Nothing
    escapes a thread: a writer that died would leave its caller waiting forever.
    """

    def __init__(self, threads: int, name: str = "azcp-writer") -> None:
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    @property
    def size(self) -> int:
        """The number of writer threads (0 once closed)."""
        return len(self._threads)

    def submit(self, work: Callable[[], object], done: Callable[[BaseException | None], None]) -> None:
        """Queue ``work``; ``done`` is called with its error (or None) once it has run."""
        if not self._threads:
            raise RuntimeError("the disk writer is closed")
        self._jobs.put((work, done))

    def close(self) -> None:
        """Stop the threads once the queued writes are done (idempotent)."""
        threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join()

    def _loop(self) -> None:
        shield()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, done = job
            error: BaseException | None = None
            try:
                work()
            except BaseException as exc:  # handed to done(): the caller decides
                error = exc
            # The callbacks are the tool's own (a queue put, a buffer back to its pool); one that
            # failed must still not take the thread, and the other writes, with it.
            with contextlib.suppress(BaseException):
                done(error)


__all__ = ["DiskWriter"]
