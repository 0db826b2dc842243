"""The listing's lean path: List Blobs over aiohttp, several in flight, parsed by the stdlib's C parser.

azure-storage-blob builds model objects for every blob and lists one page at a time: some
0.4 ms of rank-0 CPU per blob, minutes for a million. Here the same REST calls are made
directly: one listing with the ``/`` delimiter for the top of the prefix (the blobs there and
its virtual directories), then every directory listed flat, :data:`IN_FLIGHT` at once, each
page of up to 5,000 blobs parsed by ``xml.etree.ElementTree`` (expat, in C). The rules (the
prefix as a directory, markers, filters, unsafe or colliding names) are naming.select's, as
for the SDK's listing; only where the entries come from differs.

Used without a proxy (listing.list_source): through one, the SDK's listing, whose proxy
handling (tunnels, their refusals) the tool already names and tests.
"""

from __future__ import annotations

import asyncio
import random
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Iterable, Sequence
from email.utils import parsedate_to_datetime
from itertools import chain
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from azcp_cluster.config import Config
from azcp_cluster.credentials import Authorizer
from azcp_cluster.errors import ListError
from azcp_cluster.model import Listing
from azcp_cluster.naming import RawEntry, directory_prefix, select
from azcp_cluster.retry import RETRYABLE_STATUS, backoff_delay, parse_retry_after
from azcp_cluster.source import API_VERSION, BlobSource
from azcp_cluster.tls import ssl_context

PAGE = 5000  # the most List Blobs returns at once
IN_FLIGHT = 8  # directories listed at once


class _Refused(Exception):
    """The service answered with an error that is not worth retrying (or retries ran out)."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(status, code)
        self.status = status
        self.code = code


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
        last_modified=parsedate_to_datetime(modified).timestamp() if modified else 0.0,
        is_folder=folder,
    )


def list_blobs(source: BlobSource, auth: Authorizer, cfg: Config) -> Listing:
    """Return the files under ``source`` after the prefix, marker, filter and safety rules."""
    done, here, folders = list_top(source, auth, cfg)
    if done is not None:
        return done
    return finish(source, cfg, here, [list_folders(source, auth, cfg, folders)])


def list_top(source: BlobSource, auth: Authorizer, cfg: Config) -> tuple[Listing | None, list[RawEntry], list[str]]:
    """The listing's first step, on one rank: the blob the prefix names exactly (then the whole
    listing, done), else the blobs at the prefix's top and its virtual directories."""

    async def top(lister: _Lister) -> tuple[Listing | None, list[RawEntry], list[str]]:
        prefix = source.prefix
        if prefix and not prefix.endswith("/"):
            exact = await lister.properties(prefix)
            if exact is not None and not exact.is_folder:
                return select(prefix, exact, (), cfg.include, cfg.exclude), [], []
        here, folders = await lister.everything(directory_prefix(prefix), delimiter="/")
        return None, here, folders

    return _run(source, auth, cfg, top)


def list_folders(source: BlobSource, auth: Authorizer, cfg: Config, folders: Sequence[str]) -> list[RawEntry]:
    """Every blob below ``folders`` (virtual directories), listed flat, :data:`IN_FLIGHT` at once
    (the ranks share the folders out: each calls this with its own)."""

    async def below(lister: _Lister) -> list[RawEntry]:
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(folder: str) -> list[RawEntry]:
            async with gate:
                return (await lister.everything(folder))[0]

        return list(chain.from_iterable(await asyncio.gather(*(one(f) for f in folders))))

    return _run(source, auth, cfg, below) if folders else []


def finish(source: BlobSource, cfg: Config, here: Iterable[RawEntry], parts: Iterable[Iterable[RawEntry]]) -> Listing:
    """The listing from its pieces, after the prefix, marker, filter and safety rules (in name order)."""
    return select(source.prefix, None, chain(here, *parts), cfg.include, cfg.exclude)


T = TypeVar("T")


def _run(source: BlobSource, auth: Authorizer, cfg: Config, work: Callable[[_Lister], Awaitable[T]]) -> T:
    """``work`` on a session of its own; failures as one ListError line (never a URL's query)."""
    ssl = ssl_context() if source.endpoint.lower().startswith("https:") else None
    try:
        return asyncio.run(_session(source, auth, cfg, ssl, work))
    except _Refused as exc:
        raise _explain(exc.status, exc.code, source, auth.credential.origin) from None
    except _Unreachable as exc:
        raise ListError(f"cannot reach {source.endpoint}: {exc}") from None
    except (ET.ParseError, ValueError) as exc:
        raise ListError(f"{source.redacted()}: the listing's answer cannot be read ({type(exc).__name__})") from None


async def _session(
    source: BlobSource, auth: Authorizer, cfg: Config, ssl: Any, work: Callable[[_Lister], Awaitable[T]]
) -> T:
    import aiohttp

    timeout = aiohttp.ClientTimeout(sock_connect=cfg.connect_timeout, sock_read=cfg.read_timeout)
    connector = aiohttp.TCPConnector(limit=IN_FLIGHT, ssl=ssl if ssl is not None else True)
    lister = _Lister(source, auth, cfg)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
        lister.session = session
        return await work(lister)


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

    def __init__(self, source: BlobSource, auth: Authorizer, cfg: Config) -> None:
        self.source = source
        self.auth = auth
        self.cfg = cfg
        self.session: Any = None
        self.rng = random.Random()

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

    async def everything(self, prefix: str, delimiter: str = "") -> tuple[list[RawEntry], list[str]]:
        """Every page under ``prefix``: its blobs and (with ``delimiter``) its virtual directories."""
        entries: list[RawEntry] = []
        folders: list[str] = []
        marker = ""
        while True:
            query = [("restype", "container"), ("comp", "list"), ("include", "metadata"), ("maxresults", str(PAGE))]
            if prefix:
                query.append(("prefix", prefix))
            if delimiter:
                query.append(("delimiter", delimiter))
            if marker:
                query.append(("marker", marker))
            url = f"{self.source.container_url}?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query)
            _, _, body = await self._call("GET", url, ok=(200,), listing=True)
            page, more, marker = parse_page(body)
            entries += page
            folders += more
            if not marker:
                return entries, folders

    async def _call(self, method: str, url: str, ok: Iterable[int], listing: bool = False) -> tuple[int, Any, bytes]:
        import aiohttp

        auth = self.auth.list_query() if listing else self.auth.query()
        if auth:
            url += ("&" if "?" in url else "?") + auth
        attempt = 0
        while True:
            headers = {"x-ms-version": API_VERSION, **self.auth.headers()}
            retry_after = None
            try:
                async with self.session.request(method, url, headers=headers) as response:
                    body = await response.read()
                    if response.status in ok:
                        return response.status, response.headers, body
                    code = response.headers.get("x-ms-error-code", "") or str(response.reason or "")
                    if response.status not in RETRYABLE_STATUS or attempt >= self.cfg.max_retries:
                        raise _Refused(response.status, code)
                    retry_after = parse_retry_after(response.headers.get("Retry-After"), time.time())
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # connections, bodies, malformed answers
                if attempt >= self.cfg.max_retries:
                    raise _Unreachable(type(exc).__name__) from None
            await asyncio.sleep(backoff_delay(attempt, retry_after, self.rng))
            attempt += 1
