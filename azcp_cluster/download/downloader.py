"""Download one rank's share of the plan: ranged GETs pinned to the listed ETag.

asyncio with ``--concurrency`` requests in flight, each for one ``--block-size`` range, on
keep-alive connections (:mod:`azcp_cluster.download.http1`). The body is never handled in Python:
the socket (or the TLS layer) writes it straight into page-aligned buffers taken from a
pool allocated before the stage, and each batch of full buffers is written with O_DIRECT
on a thread (the GIL is released during the write) while the event loop keeps reading.
Under ``--max-bandwidth`` each request is booked on the rank's :class:`~azcp_cluster.core.throttle.Pacer`,
sent when its first bytes are due, and its body read a piece (the pacer's burst) at a time.

The buffers are writepool.py's, the writes the node writer's (dest/nodewriter.py); what a
download is asked and answers (the Fetcher interface, the LandingSink, stats) fetcher.py's;
the blocks core/blocks.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np

from azcp_cluster.azure.credentials import Authorizer
from azcp_cluster.azure.proxies import Proxy
from azcp_cluster.azure.tls import ssl_context
from azcp_cluster.core.blocks import Block, requests_for
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import AzcpError, DownloadError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.retry import Notify, Retries
from azcp_cluster.core.source import API_VERSION
from azcp_cluster.core.throttle import Booking, Pacer
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.localfs import fs_error
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.download.answers import (
    RANGE_MD5_LIMIT,
    BodyCheck,
    Retryable,
    check_answer,
    error_for,
    failed_attempt,
)
from azcp_cluster.download.fetcher import DownloadStats, LandingSink
from azcp_cluster.download.http1 import ConnectFailed, Connection, Link, TunnelRefused
from azcp_cluster.download.httpwire import Head, ProtocolError, request_bytes
from azcp_cluster.download.watchdog import BodyWatch
from azcp_cluster.download.writepool import WRITER_THREADS, RequestWrites, WritePool
from azcp_cluster.run import collector
from azcp_cluster.run.notices import NOTICES

# How often the event loop checks whether another rank failed.
PEER_POLL_SECONDS = 0.1
# Requests in flight while auto download workers are judged (Downloader's ``handover``): few,
# so that most of the rank's blocks are still there to hand over; ample for one process's rate.
PROBE_REQUESTS = 8


class Downloader:
    """Fetches blocks into the rank's temporary files. One instance per stage run."""

    _writes: WritePool  # the buffers of the current run
    _writer: NodeWriter  # the node's writer of the current run

    def __init__(
        self,
        files: Sequence[FileEntry] | Mapping[int, FileEntry],
        tree: DestTree,
        auth: Authorizer,
        cfg: Config,
        *,
        peer_failed: Callable[[], bool] = lambda: False,
        sink: LandingSink | None = None,
        rng: random.Random | None = None,
        pacer: Pacer | None = None,
        pool: WritePool | None = None,
        writer: NodeWriter | None = None,
        proxy: Proxy | None = None,
        handover: Callable[[], bool | None] | None = None,
        notify: Notify | None = NOTICES.retrying,
    ) -> None:
        self.files = files
        self.notify = notify  # told of each retry: the process's notices, or a worker's rank
        # Auto download workers (workers.AutoDownloader): asked at every watchdog tick until it
        # answers. True: the blocks no request has taken go elsewhere; the requests in flight
        # end, and run() returns with the rest in ``left``, in their order. False: the rank
        # keeps them all. Until it answers, only PROBE_REQUESTS are in flight, so that most
        # blocks are still there to hand over; then --concurrency.
        self.handover = handover
        self.left: list[Block] = []
        self.received = 0  # body bytes received so far, counted per buffer (a block lands whole, later)
        self._tls: ssl.SSLContext | None = None  # https: made in run()
        self.proxy = proxy  # HTTPS_PROXY / HTTP_PROXY for the storage endpoint (see proxies.py), or None
        self.pacer = pacer  # --max-bandwidth: this rank's (or worker's) share of the cap
        self.tree = tree  # the node's DEST: temporary files are opened through it, never by path
        self.auth = auth
        self.cfg = cfg
        self.peer_failed = peer_failed
        # Told of each block once all its bytes are written: the progress bar, the journal,
        # streaming (its transfer may then go out).
        self.sink = sink if sink is not None else LandingSink()
        # Each block's CRC-32 (0.06 to 0.07 s of a core per GiB here) only for whom it is: the
        # journal, --verify's source pieces, a worker's rank (which tells its own sink).
        self._hashing = any(x is not None for x in (self.sink.journal, self.sink.hashes, self.sink.report))
        self.rng = rng or random.Random()
        self.stats = DownloadStats()
        self._active: set[BodyWatch] = set()
        self._stopping = False  # set when the run ends early: workers take no new block
        self._handing_over = False  # set when ``handover`` said so: workers take no new block
        # The requests no worker has taken (run): each a run of blocks one ranged GET fetches.
        self._queue: asyncio.Queue[list[Block]] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []  # the request loops, one per request in flight
        # The buffers (the pipeline maps them at allocation, before the stage's clock starts)
        # and the node's writer, both the caller's; without them (a downloader on its own),
        # run() makes its own for the run and closes them at its end.
        self._pool = pool
        self._node_writer = writer

    def run(self, blocks: Sequence[Block]) -> DownloadStats:
        """Download every block; raise :class:`DownloadError` (or PeerFailed) on failure."""
        # Everything alive now (libraries, the listing: a million FileEntry objects for a
        # large dataset) is moved out of the cyclic collector's way for the transfer; its
        # full collections, triggered by the event loop's allocations, walked all of it
        # (about 4% of the client's CPU here). Undone afterwards.
        collector.hold()
        try:
            if blocks:
                with contextlib.ExitStack() as made:
                    writer = self._node_writer
                    if writer is None:  # made for this run, closed at its end
                        writer = made.enter_context(NodeWriter(self.files, self.tree, WRITER_THREADS))
                    self._writer = writer
                    self._writes = self._pool if self._pool is not None else WritePool(self.cfg)
                    asyncio.run(self._run(blocks))
        finally:
            collector.release()  # (what the pipeline froze stays frozen: collector.py counts)
        return self.stats

    async def _run(self, blocks: Sequence[Block]) -> None:
        self._writes.bind(asyncio.get_running_loop())
        queue: asyncio.Queue[list[Block]] = asyncio.Queue()
        for request in requests_for(blocks, self.cfg.block_size):
            queue.put_nowait(request)
        # REQUESTS_CA_BUNDLE / SSL_CERT_FILE name a private CA for the listing and these GETs
        # alike. Loading the CA store takes about 40 ms: not paid where it is not used (http).
        https = self.auth.source.endpoint.lower().startswith("https:")
        self._tls = ssl_context() if https else None
        self._queue = queue
        first = self.cfg.concurrency if self.handover is None else min(PROBE_REQUESTS, self.cfg.concurrency)
        workers = self._workers
        workers += [asyncio.create_task(self._worker(queue)) for _ in range(min(first, queue.qsize()))]
        watcher = asyncio.create_task(self._watch_peers())
        try:
            while any(not w.done() for w in workers):
                # Looked at again each tick: the watchdog may have added requests (_grow).
                live = {w for w in workers if not w.done()} | {watcher}
                done, _ = await asyncio.wait(live, timeout=PEER_POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    error = task.exception()
                    if error is not None:
                        raise error
            for task in workers:  # one that failed as the last others ended
                error = task.exception()
                if error is not None:
                    raise error
        finally:
            # Also a flag: asyncio.wait_for can swallow a cancellation that races with the
            # awaited call's end, and such a worker would go on through the queue.
            self._stopping = True
            for task in [*workers, watcher]:
                task.cancel()
            await asyncio.gather(*workers, watcher, return_exceptions=True)
        while not queue.empty():  # handed over: what no request took
            self.left.extend(queue.get_nowait())

    async def _watch_peers(self) -> None:
        """Stop when another rank fails; drop connections whose body sent nothing for read_timeout.

        No per-read timer: one scan of the active requests a tick finds stalled bodies.
        """
        from azcp_cluster.run.cluster import PeerFailed

        while True:
            await asyncio.sleep(PEER_POLL_SECONDS)
            if self.peer_failed():
                raise PeerFailed()
            if self.handover is not None:
                verdict = self.handover()
                if verdict is not None:
                    self.handover = None
                    if verdict:
                        self._handing_over = True
                    else:
                        self._grow()
            for watch in list(self._active):
                watch.look(PEER_POLL_SECONDS, self.cfg.read_timeout)

    def _grow(self) -> None:
        """Up to --concurrency requests in flight (the probe of auto download workers had fewer)."""
        more = min(self.cfg.concurrency - len(self._workers), self._queue.qsize())
        self._workers += [asyncio.create_task(self._worker(self._queue)) for _ in range(max(0, more))]

    async def _worker(self, queue: asyncio.Queue[list[Block]]) -> None:
        link = Link()  # this worker's keep-alive connection, reused from request to request
        try:
            while not self._stopping and not self._handing_over:
                try:
                    request = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await self._fetch(link, request)
        finally:
            link.drop()

    async def _fetch(self, link: Link, request: list[Block]) -> None:
        """One ranged GET for ``request`` (consecutive blocks of one file), retried from its
        first block that has not landed."""
        entry = self.files[request[0].file]
        retries = Retries(self.cfg.max_retries, self.rng, asyncio.sleep, self.notify)
        while True:
            length = sum(block.length for block in request)
            booking = None
            if self.pacer is not None:
                # Each attempt books its bytes (a retry is bytes sent again: it pays again);
                # the request goes when its first piece is due, the rest as it is read.
                booking = self.pacer.book(length)
                await _pace(self.pacer.delay(booking, min(length, self.pacer.piece)))
            landed: list[Block] = []  # its blocks landed in this attempt, in order
            try:
                await self._get_once(link, request, entry, booking, landed)
                return
            except (Retryable, asyncio.TimeoutError, OSError, TunnelRefused, ProtocolError) as exc:
                cause, retry_after, detail = failed_attempt(exc, entry)
            request = request[len(landed) :]  # what landed stays landed: never twice
            if not request:
                return  # (the error came once every block had landed)
            first, length = request[0], sum(block.length for block in request)
            if retries.exhausted:
                raise DownloadError(
                    f"giving up after {retries.attempt} retries of bytes {first.offset}-{first.offset + length - 1}: "
                    f"last cause {cause}" + (f" ({detail})" if detail else ""),
                    path=entry.name,
                )
            self.stats.retries += 1
            self.stats.retry_causes[cause] += 1
            what = f"GET of {entry.name!r} bytes {first.offset}-{first.offset + length - 1}"
            await retries.pause(retry_after, what, detail or cause)

    async def _get_once(
        self, link: Link, blocks: list[Block], entry: FileEntry, booking: Booking | None, landed: list[Block]
    ) -> None:
        start = blocks[0].offset
        end = blocks[-1].offset + blocks[-1].length
        headers = {
            "x-ms-version": API_VERSION,
            "Range": f"bytes={start}-{end - 1}",
        }
        if entry.etag:
            headers["If-Match"] = entry.etag
        # Over plain HTTP nothing vouches for a body's bytes: where the service can, it sends the
        # range's MD5 (answers.RANGE_MD5_LIMIT), and the body is checked before a block lands. Not
        # for a whole blob: the service then gives the blob's stored Content-MD5 property, which
        # may be stale (Put Page, Append Block) and is --verify's to check, not the download's.
        md5_asked = self._tls is None and end - start <= RANGE_MD5_LIMIT and (start, end) != (0, entry.size)
        if md5_asked:
            headers["x-ms-range-get-content-md5"] = "true"
        headers.update(self.auth.headers())
        url = self.auth.blob_url(entry.name)
        request = self._request(url, headers)
        self.stats.requests += 1
        conn = link.conn
        if conn is None or not conn.reusable:
            link.drop()
            conn = link.conn = await self._connect(url)
        try:
            # One timer per request for the head; the body is watched by the watchdog.
            head = await asyncio.wait_for(conn.request(request), self.cfg.read_timeout)
            if head.status not in (200, 206):
                await self._raise_for_status(head, entry)
            check_answer(head, start, end, entry)
            body = BodyCheck.of(head, md5_asked)
            watch = BodyWatch(conn)
            self._active.add(watch)
            try:
                await self._stream_body(conn, head, blocks, entry, booking, landed, body)
            except (OSError, ProtocolError, Retryable):
                if watch.stalled:
                    raise Retryable(watch.cause) from None
                raise
            finally:
                self._active.discard(watch)
        finally:
            if not conn.reusable:  # an error response, a broken body, a cancelled request
                link.drop()

    def _request(self, url: str, headers: dict[str, str], method: str = "GET") -> bytes:
        """A request's bytes: to the server, or, for http through a proxy, to the proxy (the whole URL)."""
        proxy = self.proxy
        if proxy is None or self._tls is not None:  # https through a proxy: inside its tunnel
            return request_bytes(url, headers, method)
        if proxy.authorization:
            headers = {**headers, "Proxy-Authorization": proxy.authorization}
        return request_bytes(url, headers, method, absolute=True)

    async def _connect(self, url: str) -> Connection:
        """A new connection for ``url`` (through the proxy, if any), within --connect-timeout."""
        timeout = self.cfg.connect_timeout
        try:
            return await asyncio.wait_for(Connection.open(url, self._tls, self.proxy), timeout)
        except asyncio.TimeoutError:
            parts = urlsplit(url)
            what = f"proxy {self.proxy.shown}" if self.proxy is not None else f"{parts.hostname}:{parts.port or ''}"
            raise ConnectFailed(TimeoutError(f"no connection within {timeout:g} s"), what.rstrip(":")) from None

    async def _raise_for_status(self, head: Head, entry: FileEntry) -> None:
        """An error answer as its error (answers.error_for); a 412 asks whether the blob is still there."""
        # If-Match failed: the blob was replaced, or deleted (Azure and Azurite may answer a
        # deleted blob's conditional GET with 412, not 404). Ask which.
        deleted = head.status == 412 and await self._blob_exists(entry) is False
        raise error_for(head, entry, self.proxy, deleted, self.auth.credential)

    async def _blob_exists(self, entry: FileEntry) -> bool | None:
        """Whether blob ``entry`` still exists: a HEAD without If-Match on a new connection (None: no answer).

        Authorized like the GETs (the same SAS in the URL, or bearer header). Any answer but
        404 counts as "exists"; a failure to ask is "unknown", and the caller says "changed".
        """
        headers = {"x-ms-version": API_VERSION}
        headers.update(self.auth.headers())
        url = self.auth.blob_url(entry.name)
        conn: Connection | None = None
        try:
            conn = await self._connect(url)
            head = await asyncio.wait_for(conn.request(self._request(url, headers, "HEAD")), self.cfg.read_timeout)
        except (OSError, ProtocolError, TunnelRefused, asyncio.TimeoutError):
            return None
        finally:
            if conn is not None:
                conn.abort()
        return head.status != 404

    async def _stream_body(
        self,
        conn: Connection,
        head: Head,
        request: list[Block],
        entry: FileEntry,
        booking: Booking | None,
        landed: list[Block],
        body: BodyCheck | None = None,
    ) -> None:
        """Receive the body of ``request`` into the pool's buffers and hand each to the writers;
        each of its blocks lands (:meth:`_land`, into ``landed``) as soon as its own bytes are
        written, in order, while the body goes on (with ``body``: once the whole body's MD5 matched)."""
        if head.content_length != sum(block.length for block in request):
            raise Retryable("wrong length")
        path = self.tree.temp_shown(entry.path)
        # Every write of the request, block by block; its wait closes the file.
        writes = RequestWrites(asyncio.get_running_loop(), self._writer.open(request[0].file))
        lands: list[asyncio.Future[None]] = []  # each block's landing, each after the one before
        gate = body.gate if body is not None else None

        def land(block: Block, crc: int, written: asyncio.Future[BaseException | None]) -> None:
            before = lands[-1] if lands else None
            lands.append(asyncio.ensure_future(self._land(block, crc, written, before, landed, path, gate)))

        try:
            await self._receive_blocks(conn, request, booking, body, writes, land)
            if body is not None:
                body.finish()
        except BaseException as exc:
            if body is not None:
                body.abandon()
            if isinstance(exc, asyncio.CancelledError):
                for task in lands:
                    task.cancel()
            raise
        finally:
            outcomes = await self._settle(lands, writes, path)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _receive_blocks(
        self,
        conn: Connection,
        request: list[Block],
        booking: Booking | None,
        body: BodyCheck | None,
        writes: RequestWrites,
        land: Callable[[Block, int, asyncio.Future[BaseException | None]], None],
    ) -> None:
        """Receive each block of ``request`` buffer by buffer, each full buffer handed to the
        writer threads (O_DIRECT; they give it back to the pool), then ``land`` it: its CRC-32
        and its writes' end. Straight into page-aligned buffers, no copy in Python; a buffer
        never spans two blocks."""
        pool, writer, target = self._writes, self._writer, writes.target
        assert target is not None  # (the request's file, opened by _stream_body)
        for block in request:
            crc = 0  # the block's CRC-32 as it arrives (journal: a rerun checks kept blocks by it)
            left, offset = block.length, block.offset
            while left:
                want = min(pool.size, left)
                full, crc = await self._receive(conn, want, offset - request[0].offset, booking, crc, body)
                pool.submit(writer, target, full, want, offset, writes, block.file)
                self.received += want
                offset += want
                left -= want
            land(block, crc, writes.block_submitted())

    async def _settle(self, lands: list[asyncio.Future[None]], writes: RequestWrites, path: str) -> list[object]:
        """The blocks read whole land (or fail) before the request ends: a retry starts after the
        last that landed; the file is closed once every write is done, also when this wait is
        cancelled. Their outcomes; a write that failed is raised first, before a network error
        it would otherwise be retried behind (onto a failing disk)."""
        try:
            outcomes: list[object] = await asyncio.gather(*lands, return_exceptions=True)
        finally:
            await writes.wait()
            if writes.target is not None and writes.target.refused:
                self.stats.direct_refused = path
        written = next((o for o in outcomes if isinstance(o, AzcpError)), None)
        if written is not None:
            raise written
        return outcomes

    async def _receive(
        self, conn: Connection, want: int, at: int, booking: Booking | None, crc: int, body: BodyCheck | None
    ) -> tuple[np.ndarray, int]:
        """The next ``want`` body bytes (``at`` bytes into the request's body) received into a pool
        buffer, which is returned (the writer gives it back) with ``crc`` carried on over them.
        Under a cap, read a piece (the pacer's burst) at a time, each once due."""
        writes, pacer = self._writes, self.pacer if booking is not None else None
        piece = pacer.piece if pacer is not None else writes.size
        buf = await writes.take()
        try:
            view = memoryview(buf)  # type: ignore[arg-type]
            got = 0
            while got < want:
                end = min(want, got + piece)
                if pacer is not None:
                    assert booking is not None
                    await _pace(pacer.delay(booking, at + end))
                try:
                    if self._hashing:
                        n, crc = await conn.read_into_crc(view[got:end], crc)  # hashed as the reads land
                    else:
                        n = await conn.read_into(view[got:end])
                except OSError:
                    raise Retryable("truncated body") from None
                got += n
            if body is not None:
                body.md5.update(view[:want])
            return buf, crc
        except BaseException:
            writes.give_back(buf)
            raise

    async def _land(
        self,
        block: Block,
        crc: int,
        written: asyncio.Future[BaseException | None],
        before: asyncio.Future[None] | None,
        landed: list[Block],
        path: str,
        gate: asyncio.Future[None] | None = None,
    ) -> None:
        """``block`` (its bytes' CRC-32 ``crc``) lands once its writes are done (``written``: their
        first error, or None) and the block before it (``before``) has landed: progress, journal,
        streaming notice (the landing sink)."""
        if before is not None:
            await before
        error = await written
        if isinstance(error, OSError):  # a failed write first: never hidden behind a retry
            raise fs_error(error, path, "write")
        if error is not None:
            raise error
        if gate is not None:  # the body's MD5 (answers.BodyCheck): none of it lands before it matched
            await gate
        landed.append(block)
        self.stats.bytes += block.length
        self.sink.add_bytes(block.length)
        self.sink.landed(block, crc)


async def _pace(seconds: float) -> None:
    """Wait ``seconds`` for the pacer (no event-loop turn when nothing is owed)."""
    if seconds > 0:
        await asyncio.sleep(seconds)
