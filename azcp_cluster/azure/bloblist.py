"""The listing's lean path: List Blobs over aiohttp, several in flight, parsed by the stdlib's C parser.

azure-storage-blob builds model objects for every blob and lists one page at a time: some
0.4 ms of rank-0 CPU per blob, minutes for a million. Here the same REST calls are made
directly: first one flat page of the prefix, up to 5,000 blobs, which is the whole listing
when it has no page after it, whatever the tree's shape (one request, through the standard
library's ``http.client``: no aiohttp to import, :class:`Plain`); else one listing with
the ``/`` delimiter for the top of the prefix (the blobs there and its virtual directories);
while there are too few directories to keep several listings in flight (a prefix holding
``train/`` alone), they are listed a level down with the delimiter too (:func:`descend`);
then every directory is listed flat, blobrest.IN_FLIGHT at once, each page of up to 5,000
blobs parsed by ``xml.etree.ElementTree`` (expat, in C). The directories the first page
holds whole are not listed again (:class:`FirstPage`). One huge
directory is listed in key ranges at once where the service takes ``startFrom``
(keyspace.py), and page after page where it does not. The rules (the
prefix as a directory, markers, filters, unsafe or colliding names) are naming.select's, as
for the SDK's listing; only where the entries come from differs.

Used without a proxy (listing.list_source): through one, the SDK's listing, whose proxy
handling (tunnels, their refusals) the tool already names and tests.

The REST calls themselves (pages, key ranges, retries, the two transports) are
blobrest.py's, and the parsing of a page blobxml.py's: this module decides what to list, how
deep and on which rank.
"""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TypeVar

from azcp_cluster.azure import blobrest
from azcp_cluster.azure.blobrest import Lister, Refused, Unreachable, gather_all
from azcp_cluster.azure.credentials import Authorizer, Credential, denied
from azcp_cluster.azure.netfailure import host_port
from azcp_cluster.azure.tls import ssl_context
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import ListError
from azcp_cluster.core.model import Listing
from azcp_cluster.core.naming import RawEntry, directory_prefix, select
from azcp_cluster.core.source import BlobSource

T = TypeVar("T")

# blobrest.PAGE and blobrest.IN_FLIGHT are read through their module (tests change them there).
MAX_DESCENT = 4  # levels below the top listed with the delimiter to find more directories
# Blobs in the flat page that tells a small directory (done with it) from one worth a level
# down: a small listing ends in a few calls, and a large one loses a page per directory.
PROBE = 2000


def list_blobs(source: BlobSource, auth: Authorizer, cfg: Config) -> Listing:
    """Return the files under ``source`` after the prefix, marker, filter and safety rules."""
    start = list_start(source, auth, cfg, blobrest.IN_FLIGHT)
    if start.done is not None:
        return start.done
    parts = [start.entries]
    folders, depth = start.folders, start.depth
    if start.continuing:  # directories of the last level down with more than a page
        found, more = list_levels(source, auth, cfg, start.continuing)
        parts.append(found)
        folders = unique(folders + more)
    while descend(len(folders), blobrest.IN_FLIGHT, depth):
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
    goes to ``flat``: listed flat, in key ranges where the service can (:meth:`Lister.flat`).
    The directories the first flat page holds whole are taken from it, never listed again
    (:class:`FirstPage`)."""

    async def start(lister: Lister) -> Start:
        first = await _first_page(lister, source, cfg)
        if isinstance(first, Start):
            return first
        return await _descend_alone(lister, first, directory_prefix(source.prefix), parallel)

    return _run(source, auth, cfg, start, answered=False)  # the first contact: see Lister.answered


async def _first_page(lister: Lister, source: BlobSource, cfg: Config) -> Start | FirstPage:
    """The listing's first requests, one at a time: the blob the prefix names exactly (then the
    whole listing), else a flat page of the prefix: the whole listing when no page follows it,
    one huge directory when it holds blobs only (listed flat), else the page as a guide to the
    directories below (:class:`FirstPage`)."""
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
    return first


async def _descend_alone(lister: Lister, first: FirstPage, top_prefix: str, parallel: int) -> Start:
    """The prefix's top with the delimiter, then a level down while :func:`descend` says so
    and the directories are few enough to list at once on this rank (more are shared out):
    each directory probed (:func:`_probe`), the big ones' first pages (:func:`_level_down`).
    Stops at a directory of more than a page, whose listing the ranks continue."""
    entries, top, _ = await lister.everything(top_prefix, delimiter="/")
    kept, folders = first.take(unique(top))
    entries += kept
    flat: list[str] = []
    depth = 0
    while descend(len(folders), parallel, depth) and len(folders) <= blobrest.IN_FLIGHT:
        found, big = await _probe(lister, first, folders)
        entries += found
        level = await _level_down(lister, big)
        entries += level.entries
        flat += level.flat
        kept, folders = first.take(unique(level.below))
        entries += kept
        depth += 1
        if level.continuing:
            return Start(None, entries, folders, level.continuing, depth, flat)
    return Start(None, entries, folders, [], depth, flat)


async def _probe(lister: Lister, first: FirstPage, folders: list[str]) -> tuple[list[RawEntry], list[str]]:
    """A flat page of PROBE blobs of each of ``folders`` the first page does not show to be big:
    the blobs of those it holds whole (a small directory is done with it, and a small listing
    ends in a few calls), and the big directories (in name order), to go a level down."""
    unknown = [folder for folder in folders if not first.big(folder)]
    probes = await _each(lister, [(folder, "") for folder in unknown], "", pages=1, size=PROBE)
    big = [folder for folder in folders if first.big(folder)]
    found: list[RawEntry] = []
    for folder, (blobs, _, marker) in zip(unknown, probes, strict=True):
        if marker:
            big.append(folder)  # its probe is dropped: listed again, a level down
        else:
            found += blobs
    return found, unique(big)


@dataclass
class _Level:
    """What the first pages of a level's directories (:func:`_level_down`) found."""

    entries: list[RawEntry] = field(default_factory=list)  # the blobs directly in them
    below: list[str] = field(default_factory=list)  # the directories in them, the next level
    continuing: list[tuple[str, str]] = field(default_factory=list)  # (directory, marker): more pages
    flat: list[str] = field(default_factory=list)  # directories of blobs only, so far: listed flat


async def _level_down(lister: Lister, big: list[str]) -> _Level:
    """Each of the ``big`` directories a level down: its first page with the delimiter (its
    blobs, its directories). One whose first page shows blobs only and more to come is
    listed flat instead, whole (this page again)."""
    pages = await _each(lister, [(folder, "") for folder in big], "/", pages=1)
    level = _Level()
    for folder, (found, more, marker) in zip(big, pages, strict=True):
        if marker and not more and found:
            level.flat.append(folder)
            continue
        level.entries += found
        level.below += more
        if marker:
            level.continuing.append((folder, marker))
    return level


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
        return self.counts.get(folder, 0) > min(PROBE, blobrest.PAGE)

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
    """Every blob below ``folders`` (virtual directories), listed flat, :data:`blobrest.IN_FLIGHT` at once
    (the ranks share the folders out: each calls this with its own)."""
    if not folders:
        return []

    async def flat(lister: Lister) -> list[RawEntry]:
        return list(chain.from_iterable(e for e, _, _ in await _each(lister, [(f, "") for f in folders], "")))

    return _run(source, auth, cfg, flat)


def list_levels(
    source: BlobSource, auth: Authorizer, cfg: Config, folders: Sequence[tuple[str, str]]
) -> tuple[list[RawEntry], list[str]]:
    """The blobs directly in ``folders`` and the virtual directories in them (in name order),
    each (directory, marker: "" from its start) listed with the ``/`` delimiter to its end,
    :data:`blobrest.IN_FLIGHT` at once."""
    if not folders:
        return [], []

    async def level(lister: Lister) -> tuple[list[RawEntry], list[str]]:
        listed = await _each(lister, folders, "/")
        return list(chain.from_iterable(e for e, _, _ in listed)), unique(chain.from_iterable(d for _, d, _ in listed))

    return _run(source, auth, cfg, level)


async def _each(
    lister: Lister, folders: Sequence[tuple[str, str]], delimiter: str, pages: int = 0, size: int = 0
) -> list[tuple[list[RawEntry], list[str], str]]:
    """Each (directory, marker) listed, :data:`blobrest.IN_FLIGHT` at once: see :meth:`Lister.everything`."""
    gate = asyncio.Semaphore(blobrest.IN_FLIGHT)

    async def one(folder: str, marker: str) -> tuple[list[RawEntry], list[str], str]:
        async with gate:
            if not delimiter and not marker and not pages:  # a whole directory, flat
                return await lister.flat(folder), [], ""
            if delimiter and not marker and not pages:  # a whole level
                return await lister.level(folder)
            return await lister.everything(folder, delimiter=delimiter, marker=marker, pages=pages, size=size)

    return await gather_all(*(one(f, m) for f, m in folders))


def finish(source: BlobSource, cfg: Config, here: Iterable[RawEntry], parts: Iterable[Iterable[RawEntry]]) -> Listing:
    """The listing from its pieces, after the prefix, marker, filter and safety rules (in name order)."""
    return select(source.prefix, None, chain(here, *parts), cfg.include, cfg.exclude)


def _run(
    source: BlobSource, auth: Authorizer, cfg: Config, work: Callable[[Lister], Awaitable[T]], answered: bool = True
) -> T:
    """``work`` on a session of its own; failures as one ListError line (never a URL's query).
    ``answered``: the endpoint answered the listing's first steps (list_start) already."""
    ssl = ssl_context() if source.endpoint.lower().startswith("https:") else None
    try:
        return asyncio.run(_session(Lister(source, auth, cfg, ssl, answered=answered), work))
    except Refused as exc:
        raise _explain(exc.status, exc.code, source, auth.credential) from None
    except Unreachable as exc:
        raise ListError(f"cannot reach {host_port(source.endpoint)} ({source.endpoint}): {exc}") from None
    except (ET.ParseError, ValueError) as exc:
        raise ListError(f"{source.redacted()}: the listing's answer cannot be read ({type(exc).__name__})") from None


async def _session(lister: Lister, work: Callable[[Lister], Awaitable[T]]) -> T:
    try:
        return await work(lister)
    finally:
        await lister.close()


def _explain(status: int, code: str, source: BlobSource, credential: Credential) -> ListError:
    """A one-line cause, as listing._explain gives for the SDK's errors; never a URL's query."""
    where = source.redacted()
    if status == 404 and code == "ContainerNotFound":
        return ListError(f"container '{source.container}' not found at {source.endpoint}")
    if status == 404:
        return ListError(f"{where}: not found ({code or 'NotFound'})")
    if status in (401, 403):
        return ListError(f"{where}: {denied(status, code, credential)}")
    return ListError(f"{where}: listing failed (HTTP {status}, {code})")
