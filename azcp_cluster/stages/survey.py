"""The list and diff stages: what SOURCE holds, and what each node's DEST already has.

``list_source`` returns a frozen :class:`Listed` (the listing, the same on every rank);
``diff`` a frozen :class:`Diff` (which files move, who already holds each).
"""

from __future__ import annotations

import os
import pickle
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple, TypeVar

import numpy as np

from azcp_cluster.core.errors import InternalError, ListError, UsageError
from azcp_cluster.core.model import FileEntry, Listing, decode_listing, encode_listing
from azcp_cluster.core.naming import RawEntry, Selected, merge, prefilter
from azcp_cluster.core.resume import Segment, segments, total
from azcp_cluster.core.source import BlobSource, parse_blob_url
from azcp_cluster.dest import journal, manifest, mirror
from azcp_cluster.dest.destroot import DestRoot
from azcp_cluster.dest.localsource import list_local
from azcp_cluster.run import figures
from azcp_cluster.run.cluster import StageOutcome, error_from_payload, error_payload
from azcp_cluster.run.console import say
from azcp_cluster.stages.context import RunContext
from azcp_cluster.stages.setup import Placement

T = TypeVar("T")


@dataclass(frozen=True)
class Listed:
    """The listing every rank received, and how long the lister took."""

    listing: Listing
    single_file: bool  # a local SOURCE that is one file, not a tree
    seconds: float  # this rank's time in the list stage


@dataclass(frozen=True)
class Diff:
    """Which files move, and where copies already are (the same on every rank but ``have``)."""

    transfer: tuple[int, ...]  # files some node lacks, ascending
    holders: tuple[tuple[int, ...], ...]  # per file: the leaders whose DEST already has it
    have: tuple[bool, ...]  # per file: this rank's node already has it
    # A resumed run: per file some node kept blocks of, its segments and their holders
    # (resume.segments; a whole copy holds every segment).
    partial: Mapping[int, tuple[Segment, ...]] = field(default_factory=dict)
    # What this rank's node kept (leaders; a file's temporary file is then kept, not made anew).
    kept: Mapping[int, journal.Kept] = field(default_factory=dict)
    # --delete: the files this rank's node removes after a complete copy (a leader's, as its
    # walk of DEST found them), and every node's (path, size) of them, for the dry run's lines.
    stale: tuple[mirror.Entry, ...] = ()
    stale_by: tuple[tuple[tuple[str, int], ...], ...] = ()

    def without(self, changed: list[int]) -> Diff:
        """The same, with ``changed`` held by nobody (a local file that changed while it was read)."""
        gone = set(changed)
        return Diff(
            self.transfer,
            tuple(() if i in gone else h for i, h in enumerate(self.holders)),
            tuple(False if i in gone else h for i, h in enumerate(self.have)),
            {i: s for i, s in self.partial.items() if i not in gone},
            {i: k for i, k in self.kept.items() if i not in gone},
            self.stale,
            self.stale_by,
        )


def list_source(ctx: RunContext, place: Placement) -> Listed:
    """The lister (rank 0, or the reader of a local SOURCE) lists, with the downloaders' help
    for a blob SOURCE (:func:`list_in_parallel`); everyone gets the list."""
    cluster = ctx.cluster
    t0 = cluster.clock()
    # Every rank's environment has its say: one with a proxy makes it the SDK's way on rank 0
    # (a rank must never take the other path's collectives).
    if not ctx.local and len(place.topo.downloaders) > 1 and all(cluster.allgather(place.proxy is None)):
        listing = list_in_parallel(ctx, place)
        cluster.note("list", t0)  # the timeline's: carried by the diff's agreement
        return _listed(ctx, listing, False, cluster.clock() - t0)
    payload: bytes | None = None
    listed: Listing | None = None
    outcome: StageOutcome[None] = StageOutcome()
    if ctx.rank == place.reader:
        with cluster.stage(outcome), cluster.abandonable():  # a signal stops the listing at once
            if ctx.local:
                listed = list_local(ctx.source_root, ctx.cfg)
            else:
                from azcp_cluster.azure.listing import list_source as list_blobs

                assert place.auth is not None
                listed = list_blobs(parse_blob_url(ctx.cfg.source), place.auth, ctx.cfg, place.proxy)
            payload = encode_listing(listed)
    single = ctx.local and ctx.rank == place.reader and os.path.isfile(ctx.source_root)
    message = (payload, error_payload(outcome.error) if outcome.error else None, single)
    payload, failure, single = cluster.bcast_object(message, root=place.reader)
    if failure is not None:
        raise error_from_payload(failure)
    # The reader keeps what it listed (decode_listing gives the others the same: 0.1 s of
    # its time on the path of every rank, 100,000 files).
    if listed is None and payload is None:
        raise InternalError("the lister sent neither its listing nor an error")
    listing = listed if listed is not None else decode_listing(payload or b"")
    cluster.note("list", t0)
    return _listed(ctx, listing, bool(single), cluster.clock() - t0)


def list_in_parallel(ctx: RunContext, place: Placement) -> Listing:
    """A blob SOURCE listed by several ranks (bloblist.py), the same listing on every rank.

    The lister lists the prefix's top with the ``/`` delimiter, and levels below it while
    there are too few directories to keep every helper busy, each directory's first page
    (bloblist.list_start: a small listing ends there, on one rank); the rest goes round-robin
    to the downloaders (they have the credential, and fetch a token anyway): the directories
    with more pages, the levels below while still too few, then every directory left, each
    listed flat, several at once by each rank. Each rank puts its part through the rules that
    look at one blob at a time (naming.prefilter), and every rank merges all the parts
    (naming.merge: name order, so the result does not depend on who listed what): the same
    listing everywhere, without a broadcast. Each step is an agreement: a failure on any
    rank is every rank's, with its one line.
    """
    from azcp_cluster.azure import bloblist, blobrest

    cluster = ctx.cluster
    cfg = ctx.cfg
    lister = place.reader
    source = parse_blob_url(cfg.source)
    assert place.auth is not None
    outcome: StageOutcome[None] = StageOutcome()
    helpers = list(place.topo.downloaders)
    parallel = len(helpers) * blobrest.IN_FLIGHT
    start = bloblist.Start(None, [], [], [], 0)
    if ctx.rank == lister:
        with cluster.stage(outcome), cluster.abandonable():
            start = bloblist.list_start(source, place.auth, cfg, parallel)
    # What the lister found stays with it: only the directories left to list travel.
    here = start.entries
    message = (
        start.done,
        start.folders,
        start.continuing,
        start.depth,
        start.flat,
        error_payload(outcome.error) if outcome.error else None,
    )
    done, folders, continuing, depth, flat, failure = cluster.bcast_object(message, root=lister)
    if failure is not None:
        raise error_from_payload(failure)
    if done is not None:
        return done  # the prefix named one blob

    entries, folders = _list_levels(ctx, place, source, folders, list(continuing), depth, parallel)
    outcome = StageOutcome()
    with cluster.stage(outcome), cluster.abandonable():
        mine = _share(bloblist.unique(folders + flat), helpers, ctx.rank)
        entries += bloblist.list_folders(source, place.auth, cfg, mine)
    return _merge_parts(ctx, source.prefix, chain(here, entries), outcome)


def _share(items: list[T], helpers: list[int], rank: int) -> list[T]:
    """``rank``'s share of ``items``, dealt round-robin over ``helpers`` (none if it is not one)."""
    return items[helpers.index(rank) :: len(helpers)] if rank in helpers else []


def _list_levels(
    ctx: RunContext,
    place: Placement,
    source: BlobSource,
    folders: list[str],
    levels: list[tuple[str, str]],
    depth: int,
    parallel: int,
) -> tuple[list[RawEntry], list[str]]:
    """The directories with more than a page that stopped the lister (``levels``: each with the
    marker to go on from), then each level down while there are too few directories to keep
    every helper's listings busy: shared out round-robin, and the next level's directories
    agreed by all (``depth``: the levels below the top listed so far; ``parallel``: the
    listings the helpers run at once). Returns this rank's blobs from every level and the
    directories left to list flat."""
    from azcp_cluster.azure import bloblist

    cluster = ctx.cluster
    assert place.auth is not None
    helpers = list(place.topo.downloaders)
    entries: list[RawEntry] = []  # this rank's, from every level
    while True:
        if not levels:
            if not bloblist.descend(len(folders), parallel, depth):
                break
            levels, folders, depth = [(folder, "") for folder in folders], [], depth + 1
        outcome: StageOutcome[None] = StageOutcome()
        below: list[str] = []
        with cluster.stage(outcome), cluster.abandonable():
            found, below = bloblist.list_levels(source, place.auth, ctx.cfg, _share(levels, helpers, ctx.rank))
            entries += found
        cluster.settle()
        gathered_levels = cluster.allgather((below, error_payload(outcome.error) if outcome.error else None))
        failure = next((err for _, err in gathered_levels if err is not None), None)
        if failure is not None:
            raise error_from_payload(failure)
        folders = bloblist.unique(chain(folders, chain.from_iterable(level for level, _ in gathered_levels)))
        levels = []
    return entries, folders


def _merge_parts(ctx: RunContext, prefix: str, mine: Iterable[RawEntry], listed: StageOutcome[None]) -> Listing:
    """The same listing on every rank from every rank's part (``mine``: this rank's blobs;
    ``listed``: how its listing went). The rules that look at one blob at a time run on each
    rank's own part (while the others still list); every rank then merges the same parts
    into the same listing. A listing that failed somewhere is reported before any name a
    rank found unsafe."""
    cluster = ctx.cluster
    cfg = ctx.cfg
    named: StageOutcome[None] = StageOutcome()
    part = Selected([], 0, 0)
    if listed.error is None:
        with cluster.stage(named), cluster.abandonable():
            part = prefilter(prefix, mine, cfg.include, cfg.exclude)
    # Compressed: names share their prefixes (a tenth of the pickle), and the parts' total
    # stays far below MPI's 2 GiB count for tens of millions of blobs.
    packed = zlib.compress(pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL), 1)
    cluster.settle()  # the ranks done first wait without spinning a core
    listing_failed = error_payload(listed.error) if listed.error else None
    naming_failed = error_payload(named.error) if named.error else None
    parts = cluster.allgather((packed, listing_failed, naming_failed))
    failure = next((err for _, err, _ in parts if err is not None), None)
    failure = failure or next((err for _, _, err in parts if err is not None), None)
    if failure is not None:
        raise error_from_payload(failure)
    # A colliding name: the same one line on every rank, as ever.
    return merge([pickle.loads(zlib.decompress(packed)) for packed, _, _ in parts])


def _listed(ctx: RunContext, listing: Listing, single: bool, seconds: float) -> Listed:
    """The listing's figures in the report (and the warning for an empty one)."""
    ctx.record(
        figures.Listed(len(listing.files), listing.total_bytes, listing.markers_skipped, listing.filtered_out, seconds)
    )
    if not listing.files:
        # On every rank alike (they all have the listing): a typo in a job script's SOURCE
        # must not pass its staging step. With --allow-empty, a finished copy of nothing.
        if not ctx.cfg.allow_empty:
            raise ListError(empty_source(ctx, listing))
        if ctx.rank == 0:
            what = "filters left no file" if listing.filtered_out else "SOURCE matched no files"
            say(f"azcp-cluster: warning: {what}; nothing to copy (--allow-empty)")
    return Listed(listing, single, seconds)


def empty_source(ctx: RunContext, listing: Listing) -> str:
    """Why the listing has no file, naming SOURCE (container and prefix, or the local path) and the filters."""
    cfg = ctx.cfg
    if ctx.local:
        where = f"local SOURCE {ctx.source_root}"
    else:
        source = parse_blob_url(cfg.source)
        prefix = f"prefix '{source.prefix}'" if source.prefix else "no prefix"
        where = f"container '{source.container}' at {source.endpoint} ({prefix})"
    if listing.filtered_out:
        filters = " ".join([*(f"--include {g}" for g in cfg.include), *(f"--exclude {g}" for g in cfg.exclude)])
        return (
            f"{where}: {filters} left none of its {listing.filtered_out} files "
            "(--allow-empty makes that a finished, empty copy)"
        )
    return f"{where} holds no file to copy; a typo in SOURCE? (--allow-empty makes that a finished, empty copy)"


class Seen(NamedTuple):
    """What one leader found in its DEST (the others bring nothing), as the agreement carries it."""

    present: bytes  # per file, whether it is here (packed bits)
    list_seconds: float  # this rank's time in the list stage
    kept: Mapping[int, tuple[tuple[int, int], ...]]  # per file a stopped run kept blocks of: the spans
    stale: tuple[tuple[str, int], ...] = ()  # --delete: the files this node would remove (path, size)
    sheltered: int = 0  # --delete: the files it keeps only as they lie under a dangling link of SOURCE


def diff(ctx: RunContext, place: Placement, listed: Listed) -> Diff:
    """Which files to transfer, and for each file the leaders whose copy already has it."""
    cluster = ctx.cluster
    t0 = cluster.clock()
    outcome: StageOutcome[Seen] = StageOutcome()
    files = listed.listing.files
    kept: dict[int, journal.Kept] = {}
    stale: list[mirror.Entry] = []
    sheltered = 0
    check_mirror(ctx, listed)
    with cluster.stage(outcome):
        present = b""
        if place.leader:  # one check per copy: the other ranks of a node share the leader's
            tree = ctx.dest_tree()
            with cluster.abandonable():  # hashing (--compare md5): a signal stops it at once
                bits = np.array(manifest.present(tree, files, ctx.cfg.compare), dtype=bool)
            present = np.packbits(bits).tobytes()
            if ctx.cfg.resume and tree.exists:
                lacking = np.flatnonzero(~bits).tolist()
                with cluster.abandonable():  # the kept blocks read back: a signal stops it at once
                    # --verify keeps only blocks that came from the source on this node (journal.load).
                    kept = journal.load(tree, files, lacking, ctx.origin, received=not ctx.cfg.verify)
            if ctx.cfg.delete:
                stale, sheltered = stale_in(ctx, tree, listed.listing)
        spans = {i: k.spans for i, k in kept.items()}
        outcome.stats = Seen(present, listed.seconds, spans, tuple((e.rel, e.size) for e in stale), sheltered)
    result = cluster.conclude(t0, outcome, stage="diff")
    seen = result.each(Seen(b"", 0.0, {}))
    leaders = place.topo.leaders
    warn_sheltered(ctx, listed.listing, [seen[leader].sheltered for leader in leaders])
    matrix = np.stack(
        [
            np.unpackbits(np.frombuffer(seen[leader].present, dtype=np.uint8), count=len(files)).astype(bool)
            for leader in leaders
        ]
    )  # groups x files
    everywhere = matrix.all(axis=0)
    transfer = tuple(np.flatnonzero(~everywhere).tolist())
    holders = holders_of(matrix, leaders)
    kept_by = [seen[leader].kept for leader in leaders]  # per node: file -> spans kept
    partial = resumed(files, holders, leaders, kept_by)
    ctx.record(
        figures.Compared(
            list_seconds=max(s.list_seconds for s in seen),
            resumed_files=len(partial),
            resumed_bytes=sum(total(spans) for k in kept_by for spans in k.values()),
            skipped_files=len(files) - len(transfer),
            skipped_bytes=sum(files[i].size for i in np.flatnonzero(everywhere)),
            transfer_files=len(transfer),
            peer_files=sum(1 for i in transfer if holders[i]),
            seconds=result.seconds,
        )
    )
    stale_by = tuple(seen[leader].stale for leader in leaders)
    return Diff(transfer, holders, tuple(matrix[place.group].tolist()), partial, kept, tuple(stale), stale_by)


def check_mirror(ctx: RunContext, listed: Listed) -> None:
    """``--delete`` mirrors a tree: refused (exit 2, on every rank alike) where SOURCE names one file."""
    if not ctx.cfg.delete:
        return
    files = listed.listing.files
    one_blob = (
        not ctx.local
        and len(files) == 1
        and not ctx.cfg.source.endswith("/")
        and files[0].name == parse_blob_url(ctx.cfg.source).prefix
    )
    if listed.single_file or one_blob:
        raise UsageError("--delete mirrors a directory, but SOURCE names one file; leave --delete out")


def stale_in(ctx: RunContext, tree: DestRoot, listing: Listing) -> tuple[list[mirror.Entry], int]:
    """What ``--delete`` removes from this node's DEST (mirror.choose over a walk of it), and
    how many files it keeps only because they lie under a dangling link of SOURCE."""
    cfg = ctx.cfg
    listed = [f.path for f in listing.files]
    found = mirror.walk(tree)
    stale = mirror.choose(listed, found, cfg.include, cfg.exclude, (*listing.dangling, *listing.aliases))
    if not listing.dangling:
        return stale, 0
    unsheltered = mirror.choose(listed, found, cfg.include, cfg.exclude, listing.aliases)
    return stale, len(unsheltered) - len(stale)


def warn_sheltered(ctx: RunContext, listing: Listing, sheltered: list[int]) -> None:
    """Rank 0 says how many files ``--delete`` kept under dangling links of SOURCE (every copy's counted)."""
    kept = sum(sheltered)
    if kept and ctx.rank == 0:
        copies = sum(1 for n in sheltered if n)
        say(
            f"azcp-cluster: warning: --delete kept {kept} file(s) under dangling link(s) in SOURCE "
            f"(e.g. {listing.dangling[0]!r}), in {copies} cop{'y' if copies == 1 else 'ies'}: what lies "
            "behind a link whose target is gone is unknown, not absent"
        )


def holders_of(matrix: np.ndarray, leaders: list[int] | tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Per file (a column of ``matrix``, nodes x files), the leaders whose node has it.

    Column-wise: a file nobody has and a file everybody has share one tuple each (a first
    copy and a no-op rerun of a million files make no tuple per file); only the files some
    nodes have are looked at one by one.
    """
    nobody: tuple[int, ...] = ()
    everybody = tuple(leaders)
    held = matrix.any(axis=0)
    full = matrix.all(axis=0)
    out = [nobody] * matrix.shape[1]
    for i in np.flatnonzero(full).tolist():
        out[i] = everybody
    for i in np.flatnonzero(held & ~full).tolist():
        out[i] = tuple(leaders[g] for g in np.flatnonzero(matrix[:, i]).tolist())
    return tuple(out)


def resumed(
    files: tuple[FileEntry, ...] | list[FileEntry],
    holders: tuple[tuple[int, ...], ...],
    leaders: list[int] | tuple[int, ...],
    kept_by: list[Mapping[int, tuple[tuple[int, int], ...]]],
) -> dict[int, tuple[Segment, ...]]:
    """Per file some node kept blocks of: its segments, held by the leaders that kept them
    and by those that have the whole file."""
    partial: dict[int, tuple[Segment, ...]] = {}
    for i in sorted({i for k in kept_by for i in k}):
        size = files[i].size
        holdings: dict[int, list[tuple[int, int]] | tuple[tuple[int, int], ...]] = {h: [(0, size)] for h in holders[i]}
        for leader, k in zip(leaders, kept_by, strict=True):
            if i in k:
                holdings[leader] = k[i]
        partial[i] = tuple(segments(size, holdings))
    return partial
