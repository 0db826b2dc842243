"""Download one rank's share of the plan: ranged GETs pinned to the listed ETag.

asyncio + aiohttp with ``--concurrency`` requests in flight, each for one ``--block-size``
range. The body is never handled byte by byte in Python: the ``bytes`` pieces aiohttp hands over are
copied once into page-aligned buffers taken from a pool allocated at the start, and each
full buffer is written with O_DIRECT on a thread (the GIL is released during the write)
while the event loop keeps reading the responses.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from yarl import URL

from azcp_cluster.config import Config, MiB
from azcp_cluster.credentials import Authorizer
from azcp_cluster.directio import ALIGN, DirectFile, aligned_buffer
from azcp_cluster.errors import DownloadError
from azcp_cluster.localfs import fs_error, temp_path
from azcp_cluster.model import FileEntry
from azcp_cluster.plan import Shard, round_up
from azcp_cluster.retry import RETRYABLE_STATUS, backoff_delay, parse_retry_after
from azcp_cluster.throttle import Pacer
from azcp_cluster.tls import ssl_context

API_VERSION = "2023-11-03"
# Size of one pool buffer. Buffers reused last-in first-out stay in the CPU caches while
# they fill; 4 MiB ones did not, and the copy then cost a third of the throughput.
FLUSH_BYTES = 1 * MiB
# Full buffers of one response written by one pwritev: O_DIRECT costs CPU per call
# (0.19 CPU-s/GiB at 1 MiB, 0.09 at 4 MiB here), so fewer, larger writes.
WRITE_BATCH = 4
# The pool: two buffers per request in flight plus these spares; (2 x concurrency + 16) x
# 1 MiB in all (144 MiB at the default 64). A request that finds the pool empty hands its
# partial batch to the writers first, so it never waits while holding buffers.
SPARE_BUFFERS = 16
# O_DIRECT writes are synchronous: a few threads keep several in flight.
WRITER_THREADS = 2
# How often the event loop checks whether another rank failed.
PEER_POLL_SECONDS = 0.1


def pool_buffers(concurrency: int) -> int:
    """Buffers in the download pool: two per request in flight, plus spares."""
    return 2 * concurrency + SPARE_BUFFERS


def pool_bytes(concurrency: int) -> int:
    """Memory the download pool takes at most (stated in the README, checked at start-up)."""
    return pool_buffers(concurrency) * FLUSH_BYTES


@dataclass(frozen=True)
class Block:
    """One ranged GET: ``length`` bytes of file ``file`` at ``offset``."""

    file: int
    offset: int
    length: int


@dataclass
class DownloadStats:
    """What one rank's download did."""

    bytes: int = 0
    requests: int = 0
    retries: int = 0
    retry_causes: Counter[str] = field(default_factory=Counter)
    direct_refused: str = ""  # a path whose filesystem refused O_DIRECT, if any


class _Retryable(Exception):
    def __init__(self, cause: str, retry_after: float | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.retry_after = retry_after


def blocks_for(shards: Sequence[Shard], block_size: int) -> list[Block]:
    """Cut shards into ranged-GET blocks of at most ``block_size`` bytes."""
    blocks = []
    for shard in shards:
        offset, end = shard.offset, shard.offset + shard.length
        while offset < end:
            length = min(block_size, end - offset)
            blocks.append(Block(shard.file, offset, length))
            offset += length
    return blocks


class Downloader:
    """Fetches blocks into the rank's temporary files. One instance per stage run."""

    def __init__(
        self,
        files: Sequence[FileEntry],
        dest: str,
        auth: Authorizer,
        cfg: Config,
        *,
        peer_failed: Callable[[], bool] = lambda: False,
        on_bytes: Callable[[int], None] = lambda n: None,
        rng: random.Random | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.files = files
        self.pacer = pacer  # --max-bandwidth: this rank's share of the cap
        self.dest = dest
        self.auth = auth
        self.cfg = cfg
        self.peer_failed = peer_failed
        self.on_bytes = on_bytes
        self.rng = rng or random.Random()
        self.stats = DownloadStats()
        self._active: set[_Watch] = set()
        self.flush_bytes = max(ALIGN, min(FLUSH_BYTES, round_up(cfg.block_size, ALIGN)))
        self._writes = _WriterPool(WRITER_THREADS, pool_buffers(cfg.concurrency), self.flush_bytes)

    def run(self, blocks: Sequence[Block]) -> DownloadStats:
        """Download every block; raise :class:`DownloadError` (or PeerFailed) on failure."""
        try:
            if blocks:
                asyncio.run(self._run(blocks))
        finally:
            self._writes.close()
        return self.stats

    async def _run(self, blocks: Sequence[Block]) -> None:
        queue: asyncio.Queue[Block] = asyncio.Queue()
        for block in blocks:
            queue.put_nowait(block)
        # No per-read timeout: aiohttp would re-arm a timer for every piece received. The
        # watchdog finds stalled bodies instead, with one scan of the active requests a tick.
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.cfg.connect_timeout, sock_connect=self.cfg.connect_timeout
        )
        # REQUESTS_CA_BUNDLE / SSL_CERT_FILE name a private CA for the listing and these GETs alike.
        connector = aiohttp.TCPConnector(
            limit=self.cfg.concurrency, limit_per_host=0, ttl_dns_cache=300, ssl=ssl_context()
        )
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, skip_auto_headers=("Accept-Encoding",)
        ) as session:
            workers = [
                asyncio.create_task(self._worker(session, queue)) for _ in range(min(self.cfg.concurrency, len(blocks)))
            ]
            watcher = asyncio.create_task(self._watch_peers())
            try:
                pending: set[asyncio.Task[None]] = {*workers, watcher}
                while any(not w.done() for w in workers):
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        error = task.exception()
                        if error is not None:
                            raise error
            finally:
                for task in [*workers, watcher]:
                    task.cancel()
                await asyncio.gather(*workers, watcher, return_exceptions=True)

    async def _watch_peers(self) -> None:
        """Stop when another rank fails; close bodies that sent nothing for read_timeout."""
        from azcp_cluster.cluster import PeerFailed

        while True:
            await asyncio.sleep(PEER_POLL_SECONDS)
            if self.peer_failed():
                raise PeerFailed()
            for watch in list(self._active):
                if watch.received != watch.seen:
                    watch.seen, watch.idle = watch.received, 0.0
                    continue
                watch.idle += PEER_POLL_SECONDS
                if watch.idle >= self.cfg.read_timeout and not watch.stalled:
                    watch.stalled = True
                    watch.resp.close()  # the pending read fails and the block is retried

    async def _worker(self, session: aiohttp.ClientSession, queue: asyncio.Queue[Block]) -> None:
        while True:
            try:
                block = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await self._fetch(session, block)

    async def _fetch(self, session: aiohttp.ClientSession, block: Block) -> None:
        entry = self.files[block.file]
        attempt = 0
        while True:
            if self.pacer is not None:
                # Paced before the request: a retry is bytes sent again, so it pays again.
                await asyncio.sleep(self.pacer.reserve(block.length))
            try:
                await self._get_once(session, block, entry)
                self.stats.bytes += block.length
                return
            except _Retryable as exc:
                cause, retry_after = exc.cause, exc.retry_after
            except (aiohttp.ClientError, ConnectionError) as exc:
                # Broken bodies, resets, malformed responses from a proxy: all retried. The
                # cause is the class name only: aiohttp's messages carry the URL and its SAS.
                cause, retry_after = type(exc).__name__, None
            except asyncio.TimeoutError:
                cause, retry_after = "timeout", None
            if attempt >= self.cfg.max_retries:
                raise DownloadError(
                    f"giving up after {attempt} retries of bytes {block.offset}-{block.offset + block.length - 1}: "
                    f"last cause {cause}",
                    path=entry.name,
                )
            self.stats.retries += 1
            self.stats.retry_causes[cause] += 1
            await asyncio.sleep(backoff_delay(attempt, retry_after, self.rng))
            attempt += 1

    async def _get_once(self, session: aiohttp.ClientSession, block: Block, entry: FileEntry) -> None:
        headers = {
            "x-ms-version": API_VERSION,
            "Range": f"bytes={block.offset}-{block.offset + block.length - 1}",
        }
        if entry.etag:
            headers["If-Match"] = entry.etag
        headers.update(self.auth.headers())
        url = URL(self.auth.blob_url(entry.name), encoded=True)
        self.stats.requests += 1
        # One timer per request for the headers; the body is watched by the watchdog.
        resp = await asyncio.wait_for(session.get(url, headers=headers, allow_redirects=False), self.cfg.read_timeout)
        watch = _Watch(resp)
        self._active.add(watch)
        try:
            if resp.status not in (200, 206):
                self._raise_for_status(resp, entry)
            if resp.status == 200 and not (block.offset == 0 and block.length == entry.size):
                raise DownloadError("server ignored the Range header (HTTP 200 for a ranged GET)", path=entry.name)
            await self._stream_body(resp, block, entry, watch)
        except (aiohttp.ClientError, ConnectionError, _Retryable):
            if watch.stalled:
                raise _Retryable("timeout") from None
            raise
        finally:
            self._active.discard(watch)
            resp.release()

    def _raise_for_status(self, resp: aiohttp.ClientResponse, entry: FileEntry) -> None:
        status = resp.status
        code = resp.headers.get("x-ms-error-code", resp.reason or "")
        if status in RETRYABLE_STATUS:
            retry_after = parse_retry_after(resp.headers.get("Retry-After"), time.time())
            raise _Retryable(str(status), retry_after)
        if status == 412:
            raise DownloadError(
                "the blob changed during the copy (its ETag no longer matches the listing); "
                "rerun to copy the new version",
                path=entry.name,
            )
        if status == 404:
            raise DownloadError(f"the blob disappeared during the copy (HTTP 404, {code})", path=entry.name)
        if status in (401, 403):
            raise DownloadError(f"access denied (HTTP {status}, {code}); check the credentials", path=entry.name)
        raise DownloadError(f"unexpected HTTP {status} ({code})", path=entry.name)

    async def _stream_body(self, resp: aiohttp.ClientResponse, block: Block, entry: FileEntry, watch: _Watch) -> None:
        length = resp.content_length
        if length is not None and length != block.length:
            raise _Retryable(f"wrong length {length}")
        path = temp_path(self.dest, entry.path)
        try:
            target = DirectFile(path)
        except OSError as exc:
            raise fs_error(exc, path, "open temporary file") from None
        # The body is copied once, from aiohttp's pieces into small page-aligned buffers
        # (small so they stay in cache while they fill), and each full buffer goes to the
        # writer threads, which write it with O_DIRECT and put it back in the pool.
        tracker = _BlockWrites(asyncio.get_running_loop())
        writes = self._writes
        batch: list[np.ndarray] = []  # full buffers not yet handed to the writers
        buf: np.ndarray | None = None
        try:
            buf = await writes.take()
            view_out = memoryview(buf)  # type: ignore[arg-type]
            filled = 0
            batch_at = block.offset  # file offset of batch[0]
            received = 0
            while True:
                piece = await resp.content.readany()
                if not piece:
                    break
                received += len(piece)
                watch.received = received
                if received > block.length:
                    raise _Retryable("body longer than the range")
                size = len(piece)
                if size < self.flush_bytes - filled:  # the common case: the piece fits
                    view_out[filled : filled + size] = piece
                    filled += size
                    continue
                view_in = memoryview(piece)
                while view_in:
                    take = min(len(view_in), self.flush_bytes - filled)
                    view_out[filled : filled + take] = view_in[:take]
                    filled += take
                    view_in = view_in[take:]
                    if filled == self.flush_bytes:
                        batch.append(buf)
                        buf = None
                        # Hand the batch over when it is complete, or early when the pool
                        # is empty: a request never waits for buffers while holding some.
                        if len(batch) == WRITE_BATCH or not writes.free:
                            writes.submit(target, batch, self.flush_bytes, batch_at, tracker)
                            batch_at += len(batch) * self.flush_bytes
                            batch = []
                        filled = 0
                        buf = await writes.take()
                        view_out = memoryview(buf)  # type: ignore[arg-type]
            if received != block.length:
                raise _Retryable("truncated body")
            if filled:
                batch.append(buf)
                buf = None
            if batch:
                writes.submit(target, batch, filled or self.flush_bytes, batch_at, tracker)
                batch = []
        finally:
            for unused in batch if buf is None else [*batch, buf]:
                writes.give_back(unused)
            await tracker.wait()
            if target.refused:
                self.stats.direct_refused = path
            target.close()
        if isinstance(tracker.error, OSError):
            raise fs_error(tracker.error, path, "write")
        if tracker.error is not None:
            raise tracker.error
        self.on_bytes(block.length)


class _Watch:
    """Progress of one response body, for the stall watchdog."""

    __slots__ = ("idle", "received", "resp", "seen", "stalled")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.received = 0
        self.seen = 0
        self.idle = 0.0
        self.stalled = False


class _BlockWrites:
    """Completion of one block's buffered writes, signalled from the writer threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.outstanding = 0
        self.closed = False
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
        if wake:
            self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def wait(self) -> None:
        """Wait until every write submitted for the block has finished."""
        with self.lock:
            self.closed = True
            if self.outstanding == 0:
                return
        await self.done


class _WriterPool:
    """Writer threads fed through a queue, and the pool of aligned buffers they recycle.

    Submitting costs a queue put (no event-loop wake-up per buffer); the event loop is
    woken once per block, when the block's last write has finished.
    """

    def __init__(self, threads: int, buffers: int, size: int) -> None:
        self.free: deque[np.ndarray] = deque(aligned_buffer(size) for _ in range(buffers))
        self.jobs: queue.SimpleQueue[tuple[DirectFile, list[np.ndarray], int, int, _BlockWrites] | None] = (
            queue.SimpleQueue()
        )
        self.threads = [
            threading.Thread(target=self._loop, name=f"azcp-writer-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    async def take(self) -> np.ndarray:
        """A free buffer; waits (briefly, repeatedly) while every buffer is being written."""
        while not self.free:
            await asyncio.sleep(0.0005)
        return self.free.pop()

    def give_back(self, buf: np.ndarray) -> None:
        """Return an unused buffer to the pool."""
        self.free.append(buf)

    def submit(self, target: DirectFile, bufs: list[np.ndarray], last: int, offset: int, tracker: _BlockWrites) -> None:
        """Queue full ``bufs`` (the last one filled to ``last`` bytes) for one write at ``offset``.

        The buffers come back to the pool once written.
        """
        tracker.started()
        self.jobs.put((target, bufs, last, offset, tracker))

    def close(self) -> None:
        """Stop the threads once the queued writes are done."""
        for _ in self.threads:
            self.jobs.put(None)
        for thread in self.threads:
            thread.join()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            target, bufs, last, offset, tracker = job
            error: BaseException | None = None
            try:
                target.write_many([*bufs[:-1], bufs[-1][:last]], offset)
            except BaseException as exc:  # a writer that died would leave its block waiting forever
                error = exc
            finally:
                self.free.extend(bufs)
                tracker.finished(error)


__all__ = ["Block", "DownloadStats", "Downloader", "blocks_for"]
