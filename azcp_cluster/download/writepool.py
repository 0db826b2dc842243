"""The download's buffers: a pool of page-aligned buffers the bodies land in, each full one
handed to the node's writer (:class:`~azcp_cluster.dest.nodewriter.NodeWriter`), which writes it
with O_DIRECT and gives it back.

Apart from the requests (downloader.py) because it outlives them: the pipeline makes the
pool at allocation, before the download stage's clock starts (its memory mapped up front),
and a download worker process makes its own. Its sizes (:func:`azcp_cluster.core.blocks.pool_bytes`)
are what the README states and the start-up memory check takes.

Streaming, a node's leader downloads on a thread beside its fan-out, and each transfer it
roots leaves once its bytes have landed. Its pool then holds a few written buffers instead
of taking them back (:meth:`WritePool.hold_written`), and the fan-out copies a transfer's
bytes from them into its slot (:meth:`WritePool.copy_held`) instead of reading them back
from the disk, where eight hosts' writes on one disk made such reads wait up to 0.5 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import TypeVar

import numpy as np

from azcp_cluster.core.blocks import BUFFER_BYTES, pool_buffers
from azcp_cluster.core.config import Config
from azcp_cluster.core.plan import round_up
from azcp_cluster.dest.directio import ALIGN, DirectFile, aligned_buffers
from azcp_cluster.dest.nodewriter import NodeWriter

# The pool's sizes (BUFFER_BYTES, SPARE_BUFFERS, pool_buffers...) are pure arithmetic: core/blocks.py.
# O_DIRECT writes are synchronous: a few threads keep several in flight. Four, not two: a
# thread whose write has finished waits for the GIL while the event loop runs, and the
# disk idles unless others have writes queued (docs/benchmarks.md: two against four).
WRITER_THREADS = 4

_T = TypeVar("_T")


class RequestWrites:
    """Completion of one request's writes into ``target``, block by block, signalled from the
    writer threads (the request's one tracker).

    A request's blocks are received in order: :meth:`started` counts a write into the block
    being received; :meth:`block_submitted` says that block's last write is queued and gives
    the future its landing awaits, which resolves (with the block's first write error, or None)
    once all of the block's writes are done; :meth:`wait` waits for every write of the request
    and closes ``target``. The event loop is woken once per block and once at the end, never
    once per write.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, target: DirectFile | None = None) -> None:
        self.loop = loop
        self.target = target
        self.lock = threading.Lock()
        self.outstanding = 0  # the request's writes in flight
        self.submitted = False  # wait() began: every write is submitted
        self.abandoned = False  # the request stopped waiting: the last write closes the file
        self.done: asyncio.Future[None] = loop.create_future()  # every write finished, once submitted
        self._block = 0  # the block being received: its writes are counted under this number
        self._pending: dict[int, int] = {}  # block -> its writes in flight (dropped once it is complete)
        self._errors: dict[int, BaseException] = {}  # block -> its first failed write's error
        self._landings: dict[int, asyncio.Future[BaseException | None]] = {}  # submitted blocks still written

    def started(self) -> int:
        """A write into the block being received is queued; the block's number, for :meth:`finished`."""
        with self.lock:
            self.outstanding += 1
            self._pending[self._block] = self._pending.get(self._block, 0) + 1
            return self._block

    def finished(self, block: int, error: BaseException | None) -> None:
        """From a writer thread: a write into ``block`` ended (``error``: why it failed)."""
        landing = None
        with self.lock:
            self.outstanding -= 1
            self._pending[block] -= 1
            if error is not None:
                self._errors.setdefault(block, error)
            if self._pending[block] == 0 and block in self._landings:  # the block's last write
                del self._pending[block]
                landing = self._landings.pop(block)
                error = self._errors.pop(block, None)
            close = self.abandoned and self.outstanding == 0
            whole = self.submitted and self.outstanding == 0
        if landing is not None:
            self._wake(landing, error)
        if close:  # the last write of an abandoned wait: nobody else will close the file
            self._close()
        elif whole:
            self._wake(self.done, None)

    def block_submitted(self) -> asyncio.Future[BaseException | None]:
        """The block being received has all its writes queued: the future of their end (their
        first error, or None); the next writes count into the next block. On the event loop."""
        landing: asyncio.Future[BaseException | None] = self.loop.create_future()
        with self.lock:
            block = self._block
            self._block += 1
            if self._pending.get(block, 0) > 0:
                self._landings[block] = landing
                return landing
            self._pending.pop(block, None)
            error = self._errors.pop(block, None)
        landing.set_result(error)  # written already (or it had no write)
        return landing

    async def wait(self) -> None:
        """Wait until every write submitted for the request has finished, then close the file.

        Cancelled while writes are in flight, it leaves the file to the last of them: closing
        it now would pull the descriptor from under a writer thread.
        """
        with self.lock:
            self.submitted = True
            pending = self.outstanding > 0
        try:
            if pending:
                await self.done
        except BaseException:
            with self.lock:
                self.abandoned = True
                close = self.outstanding == 0
            if close:
                self._close()
            raise
        self._close()

    def _close(self) -> None:
        if self.target is not None:
            self.target.close()

    def _wake(self, future: asyncio.Future[_T], result: _T) -> None:
        """From a writer thread: resolve ``future`` on the event loop (a cancelled one stays so)."""

        def resolve() -> None:
            if not future.done():
                future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop has ended: nobody is left to wake
            self.loop.call_soon_threadsafe(resolve)


# The names of the three trackers this one replaced (issue 39), as tests/test_writepool.py uses them.
UnitWrites = BlockWrites = RequestWrites


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
        # Written buffers held for the fan-out (hold_written): (file, offset) -> (bytes, buffer).
        self.held: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self.hold_limit = 0
        self.closed = False  # close(): buffers coming back are dropped, nothing is held

    def hold_written(self, limit: int) -> None:
        """Hold up to ``limit`` written buffers (``blocks.holdable``) until the fan-out copies
        them (:meth:`copy_held`) or :meth:`close`; one more written is given back as before."""
        with self.lock:
            self.hold_limit = max(0, limit)

    def copy_held(self, file: int, offset: int, out: np.ndarray) -> bool:
        """Copy the bytes of ``file`` from ``offset`` into ``out`` (all of it) from the buffers
        held for them, and give those buffers back; False when any part is not held (the
        caller reads it from the disk). From any thread; the copy runs without the GIL."""
        end = offset + len(out)
        with self.lock:
            # Every held block inside the range leaves: a transfer is read once, so one held
            # beyond a gap would otherwise hold its buffer to the end (a few dozen at most).
            inside = sorted(key for key in self.held if key[0] == file and offset <= key[1] < end)
            taken = [(at, *self.held.pop((file, at))) for _, at in inside]
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
        freed with the last reference), hold nothing more."""
        with self.lock:
            self.closed = True
            self.hold_limit = 0
            self.held.clear()
            self.free.clear()

    def _hold(self, file: int, offset: int, length: int, buf: np.ndarray) -> bool:
        """From a writer thread, ``buf[:length]`` written at ``offset`` of ``file``: held, if there is room."""
        with self.lock:
            # The same block written again (its request retried) replaces the older copy:
            # what is held is always what the disk has.
            old = self.held.pop((file, offset), None)
            if old is None and len(self.held) >= self.hold_limit:
                return False
            self.held[(file, offset)] = (length, buf)
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
        tracker: RequestWrites,
        file: int | None = None,
    ) -> None:
        """Queue ``buf[:length]`` on ``writer`` for writing at ``offset`` (of file ``file``); ``buf``
        comes back to the pool once written, or is held (:meth:`hold_written`)."""
        block = tracker.started()

        def done(error: BaseException | None) -> None:
            # Held before the tracker hears of it: the block lands (and its transfer may be
            # read) only after this.
            if error is not None or file is None or not self._hold(file, offset, length, buf):
                self._returned(buf)
            tracker.finished(block, error)

        try:
            writer.write(target, buf[:length], offset, done)
        except BaseException as exc:  # (a closed writer): the write fails, and nobody waits for it
            done(exc)
            raise
