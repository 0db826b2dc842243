"""Download one rank's share of the plan: ranged GETs pinned to the listed ETag.

asyncio + aiohttp with ``--concurrency`` requests in flight, each for one ``--block-size``
range. The body is never copied in Python: the ``bytes`` pieces aiohttp hands over are
collected and written with one ``os.pwritev`` per few MiB, on a thread (the GIL is
released during the write), while the event loop keeps reading the other responses.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from azcp_cluster.config import Config, MiB
from azcp_cluster.credentials import Authorizer
from azcp_cluster.errors import DownloadError
from azcp_cluster.localfs import fs_error, open_temp, pwritev_all, temp_path
from azcp_cluster.model import FileEntry
from azcp_cluster.plan import Shard
from azcp_cluster.retry import RETRYABLE_STATUS, backoff_delay, parse_retry_after

API_VERSION = "2023-11-03"
# Bytes gathered from a response before one pwritev: big enough that syscalls are rare,
# small enough that concurrency x this stays modest.
FLUSH_BYTES = 8 * MiB
MAX_IOV = 512
# How often the event loop checks whether another rank failed.
PEER_POLL_SECONDS = 0.1


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
    ) -> None:
        self.files = files
        self.dest = dest
        self.auth = auth
        self.cfg = cfg
        self.peer_failed = peer_failed
        self.on_bytes = on_bytes
        self.rng = rng or random.Random()
        self.stats = DownloadStats()
        self._pool = ThreadPoolExecutor(max_workers=max(2, min(16, cfg.concurrency)), thread_name_prefix="azcp-dl")

    def run(self, blocks: Sequence[Block]) -> DownloadStats:
        """Download every block; raise :class:`DownloadError` (or PeerFailed) on failure."""
        try:
            if blocks:
                asyncio.run(self._run(blocks))
        finally:
            self._pool.shutdown(wait=True)
        return self.stats

    async def _run(self, blocks: Sequence[Block]) -> None:
        queue: asyncio.Queue[Block] = asyncio.Queue()
        for block in blocks:
            queue.put_nowait(block)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout, sock_read=self.cfg.read_timeout)
        connector = aiohttp.TCPConnector(limit=self.cfg.concurrency, limit_per_host=0, ttl_dns_cache=300)
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
        from azcp_cluster.cluster import PeerFailed

        while True:
            await asyncio.sleep(PEER_POLL_SECONDS)
            if self.peer_failed():
                raise PeerFailed()

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
            try:
                await self._get_once(session, block, entry)
                self.stats.bytes += block.length
                return
            except _Retryable as exc:
                cause, retry_after = exc.cause, exc.retry_after
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ConnectionError) as exc:
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
        async with session.get(url, headers=headers, allow_redirects=False) as resp:
            if resp.status not in (200, 206):
                self._raise_for_status(resp, entry)
            if resp.status == 200 and not (block.offset == 0 and block.length == entry.size):
                raise DownloadError("server ignored the Range header (HTTP 200 for a ranged GET)", path=entry.name)
            await self._stream_body(resp, block, entry)

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

    async def _stream_body(self, resp: aiohttp.ClientResponse, block: Block, entry: FileEntry) -> None:
        length = resp.content_length
        if length is not None and length != block.length:
            raise _Retryable(f"wrong length {length}")
        loop = asyncio.get_running_loop()
        fd = open_temp(self.dest, entry.path, os.O_WRONLY)
        pending: asyncio.Future[int] | None = None
        try:
            pieces: list[bytes] = []
            gathered = 0
            written_to = block.offset
            received = 0
            while True:
                piece = await resp.content.readany()
                if not piece:
                    break
                received += len(piece)
                if received > block.length:
                    raise _Retryable("body longer than the range")
                pieces.append(piece)
                gathered += len(piece)
                if gathered >= FLUSH_BYTES or len(pieces) >= MAX_IOV:
                    if pending is not None:
                        self._count(await pending)
                    pending = loop.run_in_executor(self._pool, self._write, fd, pieces, written_to, entry)
                    written_to += gathered
                    pieces, gathered = [], 0
            if received != block.length:
                raise _Retryable("truncated body")
            if pending is not None:
                self._count(await pending)
                pending = None
            if pieces:
                self._count(await loop.run_in_executor(self._pool, self._write, fd, pieces, written_to, entry))
        finally:
            if pending is not None:
                await asyncio.gather(pending, return_exceptions=True)
            os.close(fd)

    def _count(self, n: int) -> None:
        self.on_bytes(n)

    def _write(self, fd: int, pieces: list[bytes], offset: int, entry: FileEntry) -> int:
        try:
            return pwritev_all(fd, pieces, offset)
        except OSError as exc:
            raise fs_error(exc, temp_path(self.dest, entry.path), "write") from None


__all__ = ["Block", "DownloadStats", "Downloader", "blocks_for"]
