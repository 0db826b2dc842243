"""The REST calls of a lean listing: List Blobs pages, key ranges, retries, two transports.

Apart from the listing's strategy (bloblist.py: which directories to list, how deep, on
which rank) because this is what one listing session does with the service, whatever the
strategy asks of it: :class:`Lister` reads pages under a prefix (with or without the ``/``
delimiter, from a marker, or from a name with ``startFrom``), lists one huge directory in
key ranges at once where the service takes ``startFrom`` (keyspace.py), and retries as the
SDK would. Its first requests go one at a time through the standard library's
``http.client`` (:class:`Plain`: a listing of one page never imports aiohttp), the others
through aiohttp, :data:`IN_FLIGHT` at once.

The constants are read from this module at call time: tests make pages small here.
"""

from __future__ import annotations

import asyncio
import http.client
import random
import socket
import time
from collections.abc import Awaitable, Iterable
from email.utils import parsedate_to_datetime
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import quote, urlsplit

from azcp_cluster.azure.blobxml import parse_page
from azcp_cluster.azure.credentials import Authorizer
from azcp_cluster.azure.netfailure import hopeless, network_cause, speaks_tls, tls_hint
from azcp_cluster.core.config import Config
from azcp_cluster.core.keyspace import ascending, cut_points, in_piece, order
from azcp_cluster.core.naming import RawEntry
from azcp_cluster.core.retry import RETRYABLE_STATUS, Notify, Retries, parse_retry_after
from azcp_cluster.core.source import API_VERSION, BlobSource
from azcp_cluster.run.notices import NOTICES

if TYPE_CHECKING:
    from ssl import SSLContext

    import aiohttp

T = TypeVar("T")

PAGE = 5000  # the most List Blobs returns at once
IN_FLIGHT = 8  # directories listed at once (and the connections of a listing's aiohttp session)
# Key ranges (keyspace.py): the service version that takes startFrom, the cuts made at once,
# and how many times a range is cut again.
START_FROM_VERSION = "2026-02-06"
SPLIT = 16  # ranges per cut: enough to spread a huge directory over the listing ranks
MAX_SPLIT = 3  # cuts go three levels deep at most; a range deeper is listed uncut, from its marker


class Refused(Exception):
    """The service answered with an error that is not worth retrying (or retries ran out)."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(status, code)
        self.status = status
        self.code = code


class OutOfOrder(Exception):
    """A page of a key-range listing not in keyspace.order: list the directory page after page."""


class Unreachable(Exception):
    """The endpoint could not be reached (after the retries, or at the first contact, at once)."""


async def gather_all(*awaitables: Awaitable[T]) -> list[T]:
    """``asyncio.gather``, but one failure cancels the others: no request of a listing that
    has failed, or fallen back, goes on using the connections."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _keep(page: list[RawEntry], lo: str, hi: str | None, dropped: list[str]) -> list[RawEntry]:
    """The blobs of ``page`` in the piece (lo, hi]; the names of the others go to ``dropped``."""
    kept = []
    for entry in page:
        if in_piece(entry.name, lo, hi):
            kept.append(entry)
        else:
            dropped.append(entry.name)
    return kept


class Plain:
    """One keep-alive connection of the standard library's ``http.client``, for the requests
    a listing makes one at a time before any other (the exact name's HEAD, the first flat
    page): a listing of one page then never imports aiohttp, some 0.12 s of the lister's CPU
    where a no-op rerun of a thousand blobs takes 0.4 s. Blocking: the event loop has nothing
    else to run meanwhile, and a signal still interrupts the socket's wait."""

    def __init__(self, ssl: SSLContext | None, connect_timeout: float, read_timeout: float) -> None:
        self.ssl = ssl
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, url: str, headers: dict[str, str]) -> tuple[int, Any, bytes, str]:
        """The response to one request: its status, headers, body and reason."""
        parts = urlsplit(url)
        conn = self.conn
        if conn is None:
            host, port = parts.hostname or "", parts.port
            if parts.scheme == "https":
                conn = http.client.HTTPSConnection(host, port, timeout=self.connect_timeout, context=self.ssl)
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout)
            self.conn = conn
        try:
            if conn.sock is None:
                conn.connect()
                cast(socket.socket, conn.sock).settimeout(self.read_timeout)  # connected: each read's bound now
            conn.request(method, f"{parts.path}?{parts.query}" if parts.query else parts.path, headers=headers)
            response = conn.getresponse()
            body = response.read()
        except BaseException:
            self.close()  # a connection in an unknown state is never used again
            raise
        if response.will_close:
            self.close()
        return response.status, response.headers, body, str(response.reason or "")

    def close(self) -> None:
        """Close the connection (a later request opens another)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Lister:
    """The REST calls of one listing, with the run's credential and retries."""

    def __init__(
        self,
        source: BlobSource,
        auth: Authorizer,
        cfg: Config,
        ssl: SSLContext | None = None,
        notify: Notify | None = NOTICES.retrying,
        answered: bool = False,
    ) -> None:
        self.source = source
        self.auth = auth
        self.cfg = cfg
        self.ssl = ssl  # the TLS context of an https endpoint
        # aiohttp's, made at the first request that may have others in flight
        self.session: aiohttp.ClientSession | None = None
        # While set (plain()), the requests go one at a time through the standard library.
        self.simple: Plain | None = None
        self.rng = random.Random()
        self.start_from: bool | None = None  # whether the service takes startFrom (None: not asked)
        self.probe = asyncio.Lock()  # one probe, whichever directory asks first
        self.notify = notify  # told of each retry (the process's notices)
        # Whether the endpoint has answered anything yet (``answered``: it answered the
        # listing's first steps already). Until it has, a failure that asking again will not
        # mend (refused, no such name, TLS that cannot agree) ends the listing at once:
        # retried, it cost 8 to 15 s of silence for the same line. After it, such a failure
        # may be a blip of one of the service's front-ends in a listing of minutes: retried.
        self.answered = answered

    def plain(self, on: bool) -> None:
        """Send the next requests one at a time through ``http.client`` (``on``), or, from now
        on, through aiohttp, several at once (the plain connection is closed)."""
        if on and self.simple is None:
            self.simple = Plain(self.ssl, self.cfg.connect_timeout, self.cfg.read_timeout)
        elif not on and self.simple is not None:
            self.simple.close()
            self.simple = None

    def _named(self, name: str) -> str:
        """A blob or prefix as a retry notice names it: in its container, quoted."""
        return repr(f"{self.source.container}/{name}")

    async def close(self) -> None:
        """Close the connections."""
        self.plain(False)
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def _send(self, method: str, url: str, headers: dict[str, str]) -> tuple[int, Any, bytes, str]:
        """One request: the response's status, headers, body and reason."""
        if self.simple is not None:
            return self.simple.request(method, url, headers)
        import aiohttp

        if self.session is None:
            timeout = aiohttp.ClientTimeout(sock_connect=self.cfg.connect_timeout, sock_read=self.cfg.read_timeout)
            connector = aiohttp.TCPConnector(limit=IN_FLIGHT, ssl=self.ssl if self.ssl is not None else True)
            self.session = aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False)
        async with self.session.request(method, url, headers=headers) as response:
            return response.status, response.headers, await response.read(), str(response.reason or "")

    def _failures(self) -> tuple[type[BaseException], ...]:
        """What a failed request raises (connections, bodies, malformed answers): retried."""
        if self.simple is not None:
            return (OSError, http.client.HTTPException)
        import aiohttp

        return (aiohttp.ClientError, asyncio.TimeoutError)

    async def properties(self, name: str) -> RawEntry | None:
        """The blob named ``name`` (a HEAD), or None if there is none; a missing container raises."""
        url = f"{self.source.container_url}/{quote(name, safe='/~')}"
        status, headers, _ = await self._call("HEAD", url, (200, 404), f"HEAD of {self._named(name)}")
        if status == 404:
            code = headers.get("x-ms-error-code", "")
            if code == "ContainerNotFound":
                raise Refused(404, code)
            return None
        modified = headers.get("Last-Modified")
        return RawEntry(
            name=name,
            size=int(headers.get("Content-Length") or 0),
            etag=headers.get("ETag", ""),  # as the SDK's properties give it (in quotes)
            content_md5=headers.get("Content-MD5", ""),
            last_modified=parsedate_to_datetime(modified).timestamp() if modified else 0.0,
            is_folder=headers.get("x-ms-meta-hdi_isfolder", "").lower() == "true",
        )

    async def everything(
        self, prefix: str, delimiter: str = "", marker: str = "", pages: int = 0, size: int = 0, start_from: str = ""
    ) -> tuple[list[RawEntry], list[str], str]:
        """The pages under ``prefix`` from ``marker`` ("": the first): its blobs, (with
        ``delimiter``) its virtual directories, and the marker of the page after the last one
        read ("" at the end). ``pages`` > 0 reads that many at most; 0, to the end. Pages of
        ``size`` items (0: :data:`PAGE`). ``start_from``: the first page from that name on
        (``startFrom``; the service may ignore it: see :meth:`flat`)."""
        entries: list[RawEntry] = []
        folders: list[str] = []
        read = 0
        while True:
            query = [
                ("restype", "container"),
                ("comp", "list"),
                ("include", "metadata"),
                ("maxresults", str(min(size, PAGE) if size else PAGE)),
            ]
            if prefix:
                query.append(("prefix", prefix))
            if delimiter:
                query.append(("delimiter", delimiter))
            if marker:
                query.append(("marker", marker))
            elif start_from:  # the first page only: the others follow their marker
                query.append(("startFrom", start_from))
            url = f"{self.source.container_url}?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query)
            version = START_FROM_VERSION if start_from else API_VERSION
            what = f"listing of {self._named(prefix)}" + (f" from {start_from!r}" if start_from else "")
            _, _, body = await self._call("GET", url, (200,), what, listing=True, version=version)
            page, more, marker = parse_page(body)
            entries += page
            folders += more
            read += 1
            if not marker or read == pages:
                return entries, folders, marker

    async def level(self, prefix: str) -> tuple[list[RawEntry], list[str], str]:
        """The blobs and directories directly under ``prefix`` (the ``/`` delimiter); one whose
        first page holds blobs only, with more pages to come, is listed flat instead
        (:meth:`flat`: in key ranges where it can), which holds no directory to list."""
        entries, folders, marker = await self.everything(prefix, delimiter="/", pages=1)
        if marker and not folders and entries:
            return await self.flat(prefix), [], ""
        if marker:
            more, below, _ = await self.everything(prefix, delimiter="/", marker=marker)
            entries += more
            folders += below
        return entries, folders, ""

    async def flat(self, prefix: str) -> list[RawEntry]:
        """Every blob under ``prefix``, listed flat. One of more than a page is cut into key
        ranges listed at once (keyspace.py), where the service takes ``startFrom`` (found
        out once per listing, :meth:`takes_start_from`) and orders names as keyspace.order
        does: a page out of that order, or a range that starts before its cut, and the
        directory is listed again page after page. Elsewhere, page after page."""
        entries, _, marker = await self.everything(prefix, pages=1)
        if not marker:
            return entries
        names = [entry.name for entry in entries]
        if names and ascending(names) and await self.takes_start_from(prefix, names[-1]):
            dropped: list[str] = []  # names a piece read but left to another
            try:
                found = entries + await self._piece(prefix, names, names[-1], None, marker, 1, dropped)
                kept = {entry.name for entry in found}
                if all(name in kept for name in dropped):
                    return found
                # A name no piece kept: the service's order is not ours across a cut (a
                # tree-ordered account puts "a/x" before "a-b"). Nothing may be lost.
            except OutOfOrder:
                pass
            self.start_from = False  # for the rest of this listing too
        rest, _, _ = await self.everything(prefix, marker=marker)
        return entries + rest

    async def _piece(
        self, prefix: str, names: list[str], lo: str, hi: str | None, marker: str, depth: int, dropped: list[str]
    ) -> list[RawEntry]:
        """The blobs of the range after ``lo`` up to ``hi`` (keyspace.in_piece), from
        ``marker``; cut again, at once, while a page ends before ``hi`` (``names``: the page
        before, whose names the cuts are guessed from), down to :data:`MAX_SPLIT` levels.
        Raises :class:`OutOfOrder` where the service's order is not keyspace.order's; adds
        to ``dropped`` the names it read that are another piece's."""
        low = order(lo)
        cuts = [c for c in cut_points(prefix, names, hi, SPLIT) if order(c) > low] if depth <= MAX_SPLIT else []
        if cuts:
            bounds: list[str | None] = [lo, *cuts, hi]
            pieces = await gather_all(
                self._piece(prefix, [], lo, cuts[0], marker, MAX_SPLIT + 1, dropped),  # from its marker, uncut
                *(
                    self._range(prefix, cast(str, bounds[i]), bounds[i + 1], depth, dropped)
                    for i in range(1, len(bounds) - 1)
                ),
            )
            return list(chain.from_iterable(pieces))
        out: list[RawEntry] = []
        last = low
        high = None if hi is None else order(hi)
        while marker:
            page, _, marker = await self.everything(prefix, marker=marker, pages=1)
            keys = [order(entry.name) for entry in page]
            if keys and (keys[0] <= last or not ascending([entry.name for entry in page])):
                raise OutOfOrder  # a page that goes back: not our order (or never a loop)
            out += _keep(page, lo, hi, dropped)
            if keys:
                last = keys[-1]
                if high is not None and last > high:
                    break
        return out

    async def _range(self, prefix: str, lo: str, hi: str | None, depth: int, dropped: list[str]) -> list[RawEntry]:
        """A key range's first page from ``lo`` (``startFrom``), then :meth:`_piece` for the rest."""
        try:
            page, _, marker = await self.everything(prefix, pages=1, start_from=lo)
        except Refused as exc:
            if exc.status == 400:  # took the probe, refuses this one: page after page
                raise OutOfOrder from None
            raise
        names = [entry.name for entry in page]
        if names and (order(names[0]) < order(lo) or not ascending(names)):
            raise OutOfOrder  # startFrom ignored here, or another order
        out = _keep(page, lo, hi, dropped)
        if not marker or (names and hi is not None and order(names[-1]) > order(hi)):
            return out
        after = names[-1] if names and order(names[-1]) > order(lo) else lo
        return out + await self._piece(prefix, names, after, hi, marker, depth + 1, dropped)

    async def takes_start_from(self, prefix: str, name: str) -> bool:
        """Whether the service lists from a given name (``startFrom``, service version
        2026-02-06 on): one call for one blob from ``name``, remembered for the listing. One
        that ignores it answers with the directory's first blob, before ``name``; one that
        refuses the version or the parameter answers 400; an empty answer tells nothing, and
        counts as no."""
        async with self.probe:
            if self.start_from is None:
                query = [("restype", "container"), ("comp", "list"), ("maxresults", "1"), ("prefix", prefix),
                         ("startFrom", name)]  # fmt: skip
                url = f"{self.source.container_url}?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query)
                what = f"listing of {self._named(prefix)} from {name!r}"
                version = START_FROM_VERSION
                status, _, body = await self._call("GET", url, (200, 400), what, listing=True, version=version)
                page = parse_page(body)[0] if status == 200 else []
                self.start_from = bool(page) and order(page[0].name) >= order(name)
        return self.start_from

    async def _call(
        self, method: str, url: str, ok: Iterable[int], what: str, listing: bool = False, version: str = API_VERSION
    ) -> tuple[int, Any, bytes]:
        """One request, retried as the SDK would (``what`` it is, for the retry notices)."""
        auth = self.auth.list_query() if listing else self.auth.query()
        if auth:
            url += ("&" if "?" in url else "?") + auth
        retries = Retries(self.cfg.max_retries, self.rng, asyncio.sleep, self.notify)
        failures = self._failures()
        while True:
            headers = {"x-ms-version": version, **self.auth.headers()}
            retry_after = None
            try:
                status, got, body, reason = await self._send(method, url, headers)
                self.answered = True
                if status in ok:
                    return status, got, body
                code = got.get("x-ms-error-code", "") or reason
                if status not in RETRYABLE_STATUS or retries.exhausted:
                    raise Refused(status, code)
                retry_after = parse_retry_after(got.get("Retry-After"), time.time())
                cause = f"HTTP {status} {code}".rstrip()
            except failures as exc:
                cause = network_cause(exc) or type(exc).__name__
                if retries.exhausted or (not self.answered and hopeless(exc)):
                    raise Unreachable(cause + tls_hint(cause)) from None
                if not self.answered and self._tls_port(exc):
                    raise Unreachable("the port speaks TLS; use https://") from None
            await retries.pause(retry_after, what, cause)

    def _tls_port(self, exc: BaseException) -> bool:
        """Whether a plain-HTTP request's connection closed without an answer because the
        port speaks TLS (a TLS server drops a request it cannot read: a reset, not a refusal)."""
        parts = urlsplit(self.source.endpoint)
        if parts.scheme.lower() != "http" or not isinstance(exc, ConnectionError | http.client.HTTPException):
            return False
        return speaks_tls(parts.hostname or "", parts.port or 80, min(2.0, self.cfg.connect_timeout))
