"""The listing's lean path: List Blobs over aiohttp, several in flight, parsed by the stdlib's C parser.

azure-storage-blob builds model objects for every blob and lists one page at a time: some
0.4 ms of rank-0 CPU per blob, minutes for a million. Here the same REST calls are made
directly: first one flat page of the prefix, up to 5,000 blobs, which is the whole listing
when it has no page after it, whatever the tree's shape (one request, through the standard
library's ``http.client``: no aiohttp to import, :class:`_Plain`); else one listing with
the ``/`` delimiter for the top of the prefix (the blobs there and its virtual directories);
while there are too few directories to keep several listings in flight (a prefix holding
``train/`` alone), they are listed a level down with the delimiter too (:func:`descend`);
then every directory is listed flat, :data:`IN_FLIGHT` at once, each page of up to 5,000
blobs parsed by ``xml.etree.ElementTree`` (expat, in C). The directories the first page
holds whole are not listed again (:class:`FirstPage`). One huge
directory is listed in key ranges at once where the service takes ``startFrom``
(keyspace.py), and page after page where it does not. The rules (the
prefix as a directory, markers, filters, unsafe or colliding names) are naming.select's, as
for the SDK's listing; only where the entries come from differs.

Used without a proxy (listing.list_source): through one, the SDK's listing, whose proxy
handling (tunnels, their refusals) the tool already names and tests.
"""

from __future__ import annotations

import asyncio
import http.client
import random
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from functools import lru_cache
from itertools import chain
from typing import Any, TypeVar, cast
from urllib.parse import quote, unquote, urlsplit

from azcp_cluster.azure.credentials import Authorizer
from azcp_cluster.azure.netfailure import host_port, network_cause
from azcp_cluster.azure.tls import ssl_context
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import ListError
from azcp_cluster.core.keyspace import ascending, cut_points, in_piece, order
from azcp_cluster.core.model import Listing
from azcp_cluster.core.naming import RawEntry, directory_prefix, select
from azcp_cluster.core.retry import RETRYABLE_STATUS, backoff_delay, parse_retry_after
from azcp_cluster.core.source import API_VERSION, BlobSource

T = TypeVar("T")

PAGE = 5000  # the most List Blobs returns at once
IN_FLIGHT = 8  # directories listed at once
MAX_DESCENT = 4  # levels below the top listed with the delimiter to find more directories
# Blobs in the flat page that tells a small directory (done with it) from one worth a level
# down: a small listing ends in a few calls, and a large one loses a page per directory.
PROBE = 2000
# Key ranges (keyspace.py): the service version that takes startFrom, the cuts made at once,
# and how many times a range is cut again.
START_FROM_VERSION = "2026-02-06"
SPLIT = 16
MAX_SPLIT = 3


class _Refused(Exception):
    """The service answered with an error that is not worth retrying (or retries ran out)."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(status, code)
        self.status = status
        self.code = code


class _OutOfOrder(Exception):
    """A page of a key-range listing not in keyspace.order: list the directory page after page."""


class _Unreachable(Exception):
    """The endpoint could not be reached (after the retries)."""


def parse_page(data: bytes) -> tuple[list[RawEntry], list[str], str]:
    """One List Blobs response: its blobs, its virtual directories (with a delimiter) and the
    marker of the next page ("" at the end)."""
    root = ET.fromstring(data)
    entries: list[RawEntry] = []
    prefixes: list[str] = []
    blobs = root.find("Blobs")
    for item in blobs if blobs is not None else ():
        if item.tag == "Blob":
            entries.append(_entry(item))
        elif item.tag == "BlobPrefix":
            prefixes.append(_name(item))
    return entries, prefixes, root.findtext("NextMarker") or ""


def _name(item: ET.Element) -> str:
    name = item.find("Name")
    if name is None:
        raise ValueError("a listed item without a name")
    text = name.text or ""
    # Names with characters XML cannot carry come percent-encoded (Encoded="true").
    return unquote(text) if name.get("Encoded") == "true" else text


def _entry(item: ET.Element) -> RawEntry:
    props = item.find("Properties")
    if props is None:
        raise ValueError("a listed blob without properties")
    modified = props.findtext("Last-Modified")
    metadata = item.find("Metadata")
    folder = metadata is not None and (metadata.findtext("hdi_isfolder") or "").lower() == "true"
    return RawEntry(
        name=_name(item),
        size=int(props.findtext("Content-Length") or 0),
        etag=props.findtext("Etag") or "",  # as the SDK's listing gives it (no quotes)
        content_md5=props.findtext("Content-MD5") or "",
        last_modified=_timestamp(modified) if modified else 0.0,
        is_folder=folder,
    )


@lru_cache(maxsize=4096)
def _timestamp(http_date: str) -> float:
    """An HTTP date as seconds; cached, since the blobs of a page share their few dates (a
    third of the parse's time per blob, uncached)."""
    return parsedate_to_datetime(http_date).timestamp()


def list_blobs(source: BlobSource, auth: Authorizer, cfg: Config) -> Listing:
    """Return the files under ``source`` after the prefix, marker, filter and safety rules."""
    start = list_start(source, auth, cfg, IN_FLIGHT)
    if start.done is not None:
        return start.done
    parts = [start.entries]
    folders, depth = start.folders, start.depth
    if start.continuing:  # directories of the last level down with more than a page
        found, more = list_levels(source, auth, cfg, start.continuing)
        parts.append(found)
        folders = unique(folders + more)
    while descend(len(folders), IN_FLIGHT, depth):
        found, folders = list_levels(source, auth, cfg, [(folder, "") for folder in folders])
        parts.append(found)
        depth += 1
    parts.append(list_folders(source, auth, cfg, unique(folders + start.flat)))
    return finish(source, cfg, (), parts)


def unique(folders: Iterable[str]) -> list[str]:
    """Directories in name order, each once (a delimiter listing may name one on two pages)."""
    return sorted(set(folders))


def descend(folders: int, parallel: int, depth: int) -> bool:
    """Whether to list the known virtual directories one level down (with the delimiter)
    before listing them flat: while there are fewer than ``parallel`` listings to run at
    once (``train/`` alone would be one listing, page after page), to :data:`MAX_DESCENT`
    levels below the top. A level down lists what the flat listing would, no more: each
    directory's own blobs, and its directories for the next step."""
    return 0 < folders < parallel and depth < MAX_DESCENT


@dataclass(frozen=True)
class Start:
    """What the lister found alone (:func:`list_start`), and where the others take over."""

    done: Listing | None  # the prefix named one blob: the whole listing
    entries: list[RawEntry]  # the blobs found so far
    folders: list[str]  # the directories of level ``depth`` known to be listed next
    # Directories of level ``depth - 1`` with more than a page: (directory, marker of its
    # next page), their delimiter listings to be continued (their directories join ``folders``).
    continuing: list[tuple[str, str]]
    depth: int  # levels below the top listed (or being continued)
    # Directories of more than a page whose first showed no directory in them: listed flat
    # (in key ranges where the service can), however deep the others go.
    flat: list[str] = field(default_factory=list)


def list_start(source: BlobSource, auth: Authorizer, cfg: Config, parallel: int) -> Start:
    """The listing's first steps, on one rank: the blob the prefix names exactly (then the
    whole listing, done), else a flat page of the prefix: the whole listing when no page
    follows it (one request, whatever the tree's shape). Else the prefix's top with the
    delimiter; then, while :func:`descend` says so, a level down, each directory's first page
    only. A small listing ends here, on one rank (no rounds between ranks for a thousand
    blobs); a directory with more than a page stops it, and the rest is shared out. A
    directory of more than a page whose first shows blobs only (or a prefix that is one)
    goes to ``flat``: listed flat, in key ranges where the service can (:meth:`_Lister.flat`).
    The directories the first flat page holds whole are taken from it, never listed again
    (:class:`FirstPage`)."""

    async def start(lister: _Lister) -> Start:
        prefix = source.prefix
        lister.plain(True)  # one request at a time until the first page is read
        if prefix and not prefix.endswith("/"):
            exact = await lister.properties(prefix)
            if exact is not None and not exact.is_folder:
                return Start(select(prefix, exact, (), cfg.include, cfg.exclude), [], [], [], 0)
        top_prefix = directory_prefix(prefix)
        page, _, marker = await lister.everything(top_prefix, pages=1)
        if not marker:
            return Start(None, page, [], [], 0)  # all of it, in one request
        lister.plain(False)
        first = FirstPage.of(top_prefix, page)
        if page and not first.counts:  # blobs only: one huge directory, it seems: flat, in key ranges
            return Start(None, [], [], [], 0, [top_prefix])
        entries, top, _ = await lister.everything(top_prefix, delimiter="/")
        kept, folders = first.take(unique(top))
        entries += kept
        flat: list[str] = []
        depth = 0
        # Alone while the directories are few enough to list at once here (more are shared out).
        while descend(len(folders), parallel, depth) and len(folders) <= IN_FLIGHT:
            # First a flat page of each, PROBE blobs: a small directory is done with it, and a
            # small listing ends in a few calls. One the first page shows is bigger needs none.
            unknown = [folder for folder in folders if not first.big(folder)]
            probes = await _each(lister, [(folder, "") for folder in unknown], "", pages=1, size=PROBE)
            big = [folder for folder in folders if first.big(folder)]
            for folder, (found, _, marker) in zip(unknown, probes, strict=True):
                if marker:
                    big.append(folder)  # its probe is dropped: listed again, a level down
                else:
                    entries += found
            big = unique(big)
            # The others a level down: each one's first page (its blobs, its directories).
            pages = await _each(lister, [(folder, "") for folder in big], "/", pages=1)
            below: list[str] = []
            continuing = []
            for folder, (found, more, marker) in zip(big, pages, strict=True):
                if marker and not more and found:
                    flat.append(folder)  # blobs only, so far: the whole of it flat (this page again)
                    continue
                entries += found
                below += more
                if marker:
                    continuing.append((folder, marker))
            kept, folders = first.take(unique(below))
            entries += kept
            depth += 1
            if continuing:
                return Start(None, entries, folders, continuing, depth, flat)
        return Start(None, entries, folders, [], depth, flat)

    return _run(source, auth, cfg, start)


@dataclass(frozen=True)
class FirstPage:
    """The prefix's first flat page, when more pages follow it, and what it says of the
    directories below the prefix.

    The page holds the listing's first names in the service's order, and in any order a
    service lists by (by name, or as a tree) the names below one directory come together.
    So a directory with a name on the page that does not hold the page's last name has all
    its names on the page: it is complete, and its blobs are taken from the page instead of
    being listed again. A directory with more than a probe's worth of names on the page is
    known to be bigger than a probe, which it is not sent. The page's other blobs are
    dropped: the listing of their directory (or the top's, for the blobs directly under the
    prefix) lists them, so each blob comes from one place only.
    """

    entries: list[RawEntry]
    last: str  # the page's last name
    counts: dict[str, int]  # per directory below the prefix ("a/", "a/b/": ending in "/"): its names on the page

    @classmethod
    def of(cls, prefix: str, entries: list[RawEntry]) -> FirstPage:
        """The page of the listing of ``prefix`` (a directory prefix: "" or ending in "/")."""
        counts: dict[str, int] = {}
        start = len(prefix)
        for entry in entries:
            name = entry.name
            cut = name.find("/", start)
            while cut >= 0:
                folder = name[: cut + 1]
                counts[folder] = counts.get(folder, 0) + 1
                cut = name.find("/", cut + 1)
        return cls(entries, entries[-1].name if entries else "", counts)

    def complete(self, folder: str) -> bool:
        """Whether every blob below ``folder`` is on the page."""
        return folder in self.counts and not self.last.startswith(folder)

    def big(self, folder: str) -> bool:
        """Whether ``folder`` is known to hold more blobs than a probe reads (its probe would
        say so)."""
        return self.counts.get(folder, 0) > min(PROBE, PAGE)

    def take(self, folders: list[str]) -> tuple[list[RawEntry], list[str]]:
        """The page's blobs below the complete directories among ``folders`` (of one level),
        and the other directories, still to be listed (in their order)."""
        done = {folder for folder in folders if self.complete(folder)}
        if not done:
            return [], folders
        kept = [entry for entry in self.entries if _below(entry.name, done)]
        return kept, [folder for folder in folders if folder not in done]


def _below(name: str, folders: set[str]) -> bool:
    """Whether ``name`` lies below one of ``folders`` (directory prefixes, ending in "/")."""
    cut = name.find("/")
    while cut >= 0:
        if name[: cut + 1] in folders:
            return True
        cut = name.find("/", cut + 1)
    return False


def list_folders(source: BlobSource, auth: Authorizer, cfg: Config, folders: Sequence[str]) -> list[RawEntry]:
    """Every blob below ``folders`` (virtual directories), listed flat, :data:`IN_FLIGHT` at once
    (the ranks share the folders out: each calls this with its own)."""
    if not folders:
        return []

    async def flat(lister: _Lister) -> list[RawEntry]:
        return list(chain.from_iterable(e for e, _, _ in await _each(lister, [(f, "") for f in folders], "")))

    return _run(source, auth, cfg, flat)


def list_levels(
    source: BlobSource, auth: Authorizer, cfg: Config, folders: Sequence[tuple[str, str]]
) -> tuple[list[RawEntry], list[str]]:
    """The blobs directly in ``folders`` and the virtual directories in them (in name order),
    each (directory, marker: "" from its start) listed with the ``/`` delimiter to its end,
    :data:`IN_FLIGHT` at once."""
    if not folders:
        return [], []

    async def level(lister: _Lister) -> tuple[list[RawEntry], list[str]]:
        listed = await _each(lister, folders, "/")
        return list(chain.from_iterable(e for e, _, _ in listed)), unique(chain.from_iterable(d for _, d, _ in listed))

    return _run(source, auth, cfg, level)


async def _each(
    lister: _Lister, folders: Sequence[tuple[str, str]], delimiter: str, pages: int = 0, size: int = 0
) -> list[tuple[list[RawEntry], list[str], str]]:
    """Each (directory, marker) listed, :data:`IN_FLIGHT` at once: see :meth:`_Lister.everything`."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(folder: str, marker: str) -> tuple[list[RawEntry], list[str], str]:
        async with gate:
            if not delimiter and not marker and not pages:  # a whole directory, flat
                return await lister.flat(folder), [], ""
            if delimiter and not marker and not pages:  # a whole level
                return await lister.level(folder)
            return await lister.everything(folder, delimiter=delimiter, marker=marker, pages=pages, size=size)

    return await _all(*(one(f, m) for f, m in folders))


async def _all(*awaitables: Awaitable[T]) -> list[T]:
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


def finish(source: BlobSource, cfg: Config, here: Iterable[RawEntry], parts: Iterable[Iterable[RawEntry]]) -> Listing:
    """The listing from its pieces, after the prefix, marker, filter and safety rules (in name order)."""
    return select(source.prefix, None, chain(here, *parts), cfg.include, cfg.exclude)


def _run(source: BlobSource, auth: Authorizer, cfg: Config, work: Callable[[_Lister], Awaitable[T]]) -> T:
    """``work`` on a session of its own; failures as one ListError line (never a URL's query)."""
    ssl = ssl_context() if source.endpoint.lower().startswith("https:") else None
    try:
        return asyncio.run(_session(source, auth, cfg, ssl, work))
    except _Refused as exc:
        raise _explain(exc.status, exc.code, source, auth.credential.origin) from None
    except _Unreachable as exc:
        raise ListError(f"cannot reach {host_port(source.endpoint)} ({source.endpoint}): {exc}") from None
    except (ET.ParseError, ValueError) as exc:
        raise ListError(f"{source.redacted()}: the listing's answer cannot be read ({type(exc).__name__})") from None


async def _session(
    source: BlobSource, auth: Authorizer, cfg: Config, ssl: Any, work: Callable[[_Lister], Awaitable[T]]
) -> T:
    lister = _Lister(source, auth, cfg, ssl)
    try:
        return await work(lister)
    finally:
        await lister.close()


class _Plain:
    """One keep-alive connection of the standard library's ``http.client``, for the requests
    a listing makes one at a time before any other (the exact name's HEAD, the first flat
    page): a listing of one page then never imports aiohttp, some 0.12 s of the lister's CPU
    where a no-op rerun of a thousand blobs takes 0.4 s. Blocking: the event loop has nothing
    else to run meanwhile, and a signal still interrupts the socket's wait."""

    def __init__(self, ssl: Any, connect_timeout: float, read_timeout: float) -> None:
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


def _explain(status: int, code: str, source: BlobSource, origin: str) -> ListError:
    """A one-line cause, as listing._explain gives for the SDK's errors; never a URL's query."""
    where = source.redacted()
    used = f" ({origin}; --auth selects another)" if origin else ""
    if status == 404 and code == "ContainerNotFound":
        return ListError(f"container '{source.container}' not found at {source.endpoint}")
    if status == 404:
        return ListError(f"{where}: not found ({code or 'NotFound'})")
    if status in (401, 403):
        return ListError(f"{where}: access denied (HTTP {status}, {code}); check the credentials{used}")
    return ListError(f"{where}: listing failed (HTTP {status}, {code})")


class _Lister:
    """The REST calls of one listing, with the run's credential and retries."""

    def __init__(self, source: BlobSource, auth: Authorizer, cfg: Config, ssl: Any = None) -> None:
        self.source = source
        self.auth = auth
        self.cfg = cfg
        self.ssl = ssl  # the TLS context of an https endpoint
        self.session: Any = None  # aiohttp's, made at the first request that may have others in flight
        # While set (plain()), the requests go one at a time through the standard library.
        self.simple: _Plain | None = None
        self.rng = random.Random()
        self.start_from: bool | None = None  # whether the service takes startFrom (None: not asked)
        self.probe = asyncio.Lock()  # one probe, whichever directory asks first

    def plain(self, on: bool) -> None:
        """Send the next requests one at a time through ``http.client`` (``on``), or, from now
        on, through aiohttp, several at once (the plain connection is closed)."""
        if on and self.simple is None:
            self.simple = _Plain(self.ssl, self.cfg.connect_timeout, self.cfg.read_timeout)
        elif not on and self.simple is not None:
            self.simple.close()
            self.simple = None

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
        status, headers, _ = await self._call("HEAD", url, ok=(200, 404))
        if status == 404:
            code = headers.get("x-ms-error-code", "")
            if code == "ContainerNotFound":
                raise _Refused(404, code)
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
            _, _, body = await self._call("GET", url, ok=(200,), listing=True, version=version)
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
            except _OutOfOrder:
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
        Raises :class:`_OutOfOrder` where the service's order is not keyspace.order's; adds
        to ``dropped`` the names it read that are another piece's."""
        low = order(lo)
        cuts = [c for c in cut_points(prefix, names, hi, SPLIT) if order(c) > low] if depth <= MAX_SPLIT else []
        if cuts:
            bounds: list[str | None] = [lo, *cuts, hi]
            pieces = await _all(
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
                raise _OutOfOrder  # a page that goes back: not our order (or never a loop)
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
        except _Refused as exc:
            if exc.status == 400:  # took the probe, refuses this one: page after page
                raise _OutOfOrder from None
            raise
        names = [entry.name for entry in page]
        if names and (order(names[0]) < order(lo) or not ascending(names)):
            raise _OutOfOrder  # startFrom ignored here, or another order
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
                status, _, body = await self._call("GET", url, ok=(200, 400), listing=True, version=START_FROM_VERSION)
                page = parse_page(body)[0] if status == 200 else []
                self.start_from = bool(page) and order(page[0].name) >= order(name)
        return self.start_from

    async def _call(
        self, method: str, url: str, ok: Iterable[int], listing: bool = False, version: str = API_VERSION
    ) -> tuple[int, Any, bytes]:
        auth = self.auth.list_query() if listing else self.auth.query()
        if auth:
            url += ("&" if "?" in url else "?") + auth
        attempt = 0
        failures = self._failures()
        while True:
            headers = {"x-ms-version": version, **self.auth.headers()}
            retry_after = None
            try:
                status, got, body, reason = await self._send(method, url, headers)
                if status in ok:
                    return status, got, body
                code = got.get("x-ms-error-code", "") or reason
                if status not in RETRYABLE_STATUS or attempt >= self.cfg.max_retries:
                    raise _Refused(status, code)
                retry_after = parse_retry_after(got.get("Retry-After"), time.time())
            except failures as exc:
                if attempt >= self.cfg.max_retries:
                    raise _Unreachable(network_cause(exc) or type(exc).__name__) from None
            await asyncio.sleep(backoff_delay(attempt, retry_after, self.rng))
            attempt += 1
