"""The download's buffers: a pool of page-aligned buffers the bodies land in, each full one
handed to the node's writer (:class:`~azcp_cluster.dest.nodewriter.NodeWriter`), which writes it
with O_DIRECT and gives it back.

Apart from the requests (downloader.py) because it outlives them: the pipeline makes the
pool at allocation, before the download stage's clock starts (its memory mapped up front),
and a download worker process makes its own. Its sizes (:func:`azcp_cluster.core.blocks.pool_bytes`)
are what the README states and the start-up memory check takes.

Streaming, a node's leader downloads on a thread beside its fan-out, and each transfer it
roots leaves once its bytes have landed. Its pool then keeps a few written buffers instead
of taking them back (:meth:`WritePool.keep_landed`), and the fan-out copies a transfer's
bytes from them into its slot (:meth:`WritePool.copy_landed`) instead of reading them back
from the disk, where eight hosts' writes on one disk made such reads wait up to 0.5 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque

import numpy as np

from azcp_cluster.core.blocks import BUFFER_BYTES, pool_buffers
from azcp_cluster.core.config import Config
from azcp_cluster.core.plan import round_up
from azcp_cluster.dest.directio import ALIGN, DirectFile, aligned_buffers
from azcp_cluster.dest.nodewriter import NodeWriter

# The pool's sizes (BUFFER_BYTES, SPARE_BUFFERS, pool_buffers...) are pure arithmetic: core/blocks.py.
# O_DIRECT writes are synchronous: a few threads keep several in flight. Four, not two: a
# thread whose write has finished waits for the GIL while the event loop runs, and the
# disk idles unless others have writes queued (2 -> 4 took the benchmark's download from
# about 750 to about 820 MiB/s against a disk that does about 900 alone).
WRITER_THREADS = 4


class UnitWrites:
    """Completion of a run of writes, signalled from the writer threads: :attr:`done` resolves
    once every write is finished after :meth:`submitted` (no more will come).

    On its own, one block among several that one request fetches: it tells when the block's
    bytes are all written, so that it lands before the request ends. The request's writes are
    a :class:`BlockWrites`, which also closes the file.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.outstanding = 0
        self.closed = False  # every write submitted
        self.error: BaseException | None = None
        self.done: asyncio.Future[None] = loop.create_future()

    def started(self) -> None:
        with self.lock:
            self.outstanding += 1

    def finished(self, error: BaseException | None) -> None:
        with self.lock:
            self.outstanding -= 1
            if error is not None and self.error is None:
                self.error = error
            wake = self.closed and self.outstanding == 0
            close = self._abandoned_last()
        if close:
            self._close()
        elif wake:
            with contextlib.suppress(RuntimeError):  # the loop has ended: nobody is left to wake
                self.loop.call_soon_threadsafe(self._resolve)

    def _abandoned_last(self) -> bool:
        """Under the lock: whether this write was the last one of an abandoned wait (a file to close)."""
        return False

    def _close(self) -> None:
        """What the last write of an abandoned wait does (nothing here)."""

    def _resolve(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def submitted(self) -> bool:
        """Every write is submitted; whether some are still in flight (:attr:`done` resolves when they end)."""
        with self.lock:
            self.closed = True
            pending = self.outstanding > 0
        if not pending:
            self._resolve()
        return pending


class BlockWrites(UnitWrites):
    """Completion of one request's writes into ``target``, which :meth:`wait` closes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: DirectFile) -> None:
        super().__init__(loop)
        self.target = target
        self.abandoned = False  # the request stopped waiting: the last write closes the file

    def _abandoned_last(self) -> bool:
        return self.abandoned and self.outstanding == 0

    def _close(self) -> None:
        self.target.close()

    async def wait(self) -> None:
        """Wait until every write submitted for the request has finished, then close the file.

        Cancelled while writes are in flight, it leaves the file to the last of them: closing
        it now would pull the descriptor from under a writer thread.
        """
        try:
            if self.submitted():
                await self.done
        except BaseException:
            with self.lock:
                self.abandoned = True
                close = self.outstanding == 0
            if close:
                self.target.close()
            raise
        self.target.close()


class Both:
    """A write counted by two trackers: its request's (the file) and its block's."""

    def __init__(self, request: BlockWrites, block: UnitWrites) -> None:
        self.request = request
        self.block = block

    def started(self) -> None:
        self.request.started()
        self.block.started()

    def finished(self, error: BaseException | None) -> None:
        self.block.finished(error)
        self.request.finished(error)


class WritePool:
    """The pool of aligned buffers the node's writer writes and gives back.

    Made before the download starts (its memory mapped up front, so the stage pays no page
    faults for it) and dropped after it. Submitting costs
    a queue put (no event-loop wake-up per buffer); the event loop is woken once per block,
    when the block's last write has finished, and once per finished write while a request
    waits for a buffer. Buffers are reused last-in first-out, so the ones in use stay warm in
    the caches.
    """

    def __init__(
        self,
        cfg: Config,
        populate: bool = False,
        buffers: int | None = None,
    ) -> None:
        self.size = max(ALIGN, min(BUFFER_BYTES, round_up(cfg.block_size, ALIGN)))
        self.count = pool_buffers(cfg.concurrency) if buffers is None else buffers
        self.free: deque[np.ndarray] = deque(aligned_buffers(self.size, self.count, populate))
        self.lock = threading.Lock()
        self.waiters: deque[asyncio.Future[None]] = deque()  # requests waiting for a buffer
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop of the current run
        # Written buffers kept for the fan-out (keep_landed): (file, offset) -> (bytes, buffer).
        self.kept: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self.keep_limit = 0
        self.closed = False  # close(): buffers coming back are dropped, nothing is kept

    def keep_landed(self, limit: int) -> None:
        """Keep up to ``limit`` written buffers (``blocks.keepable``) until the fan-out copies
        them (:meth:`copy_landed`) or :meth:`close`; one more written is given back as before."""
        with self.lock:
            self.keep_limit = max(0, limit)

    def copy_landed(self, file: int, offset: int, out: np.ndarray) -> bool:
        """Copy the bytes of ``file`` from ``offset`` into ``out`` (all of it) from the buffers
        kept for them, and give those buffers back; False when any part is not kept (the
        caller reads it from the disk). From any thread; the copy runs without the GIL."""
        end = offset + len(out)
        with self.lock:
            # Every kept block inside the range leaves: a transfer is read once, so one kept
            # beyond a gap would otherwise hold its buffer to the end (a few dozen at most).
            inside = sorted(key for key in self.kept if key[0] == file and offset <= key[1] < end)
            taken = [(at, *self.kept.pop((file, at))) for _, at in inside]
        at = offset
        for start, length, _ in taken:
            if start != at:
                break
            at += length
        whole = at >= end
        try:
            if whole:
                for start, length, buf in taken:
                    n = min(length, end - start)
                    out[start - offset : start - offset + n] = buf[:n]
        finally:
            for _, _, buf in taken:  # used or not: each block is read once
                self._returned(buf)
        return whole

    def close(self) -> None:
        """The download and the fan-out are done with the pool: drop every buffer (its memory is
        freed with the last reference), keep nothing more."""
        with self.lock:
            self.closed = True
            self.keep_limit = 0
            self.kept.clear()
            self.free.clear()

    def _keep(self, file: int, offset: int, length: int, buf: np.ndarray) -> bool:
        """From a writer thread, ``buf[:length]`` written at ``offset`` of ``file``: kept, if there is room."""
        with self.lock:
            # The same block written again (its request retried) replaces the older copy:
            # what is kept is always what the disk has.
            old = self.kept.pop((file, offset), None)
            if old is None and len(self.kept) >= self.keep_limit:
                return False
            self.kept[(file, offset)] = (length, buf)
        if old is not None:
            self._returned(old[1])
        return True

    def _returned(self, buf: np.ndarray) -> None:
        """From any thread: ``buf`` is free again; a request waiting for one is woken."""
        with self.lock:
            if self.closed:
                return
            self.free.append(buf)
            wake = self.loop if self.waiters else None
        if wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended: nobody is left to wake
                wake.call_soon_threadsafe(self._wake)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use ``loop`` for wake-ups (each download runs its own event loop)."""
        self.loop = loop

    async def take(self) -> np.ndarray:
        """A free buffer; while every buffer is being written, waits for a writer to return one.

        No polling: a request polling every half millisecond cost CPU exactly when the
        disk, not the network, set the pace.
        """
        while True:
            if self.free:
                return self.free.pop()
            assert self.loop is not None
            with self.lock:  # a writer returning buffers either sees this waiter or we see its buffers
                if self.free:
                    continue
                waiter: asyncio.Future[None] = self.loop.create_future()
                self.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                with self.lock:
                    woken = waiter not in self.waiters
                    if not woken:
                        self.waiters.remove(waiter)
                if woken:
                    self._wake()  # woken, then cancelled: pass the wake-up on to another request
                raise

    def give_back(self, buf: np.ndarray) -> None:
        """Return an unused buffer to the pool (on the event loop)."""
        self.free.append(buf)
        if self.waiters:
            self._wake()

    def _wake(self) -> None:
        """On the event loop: wake as many waiting requests as there are free buffers."""
        with self.lock:
            ready = min(len(self.free), len(self.waiters))
            woken = [self.waiters.popleft() for _ in range(ready)]
        for waiter in woken:
            if not waiter.done():
                waiter.set_result(None)

    def submit(
        self,
        writer: NodeWriter,
        target: DirectFile,
        buf: np.ndarray,
        length: int,
        offset: int,
        tracker: BlockWrites | Both,
        file: int | None = None,
    ) -> None:
        """Queue ``buf[:length]`` on ``writer`` for writing at ``offset`` (of file ``file``); ``buf``
        comes back to the pool once written, or is kept (:meth:`keep_landed`)."""
        tracker.started()

        def done(error: BaseException | None) -> None:
            # Kept before the tracker hears of it: the block lands (and its transfer may be
            # read) only after this.
            if error is not None or file is None or not self._keep(file, offset, length, buf):
                self._returned(buf)
            tracker.finished(error)

        try:
            writer.write(target, buf[:length], offset, done)
        except BaseException as exc:  # (a closed writer): the write fails, and nobody waits for it
            done(exc)
            raise
