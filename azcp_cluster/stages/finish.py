"""The last stages: make every copy durable, verify it, give it its final name, record it.

Each takes the frozen :class:`~azcp_cluster.stages.transfer.Transferred` and ends in an
agreement of all ranks; no final name appears before every rank's bytes are durable
(and, with ``--verify``, checked).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress
from typing import NamedTuple

import numpy as np

from azcp_cluster.core.crc import expected
from azcp_cluster.core.digests import against_source, verdict
from azcp_cluster.core.errors import VerifyError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.dest import journal, manifest, mirror
from azcp_cluster.run import figures
from azcp_cluster.run.cluster import StageOutcome, StageResult
from azcp_cluster.stages.context import RunContext
from azcp_cluster.stages.setup import Placement
from azcp_cluster.stages.transfer import Transferred

EMPTY_MD5 = "1B2M2Y8AsgTpgAmY7PhCfg=="  # base64 MD5 of no bytes


class ReadBack(NamedTuple):
    """What one rank brings to the verify stage's agreement (a leader: its copies read back)."""

    md5: Mapping[int, str]  # file index -> MD5 of this node's copy
    crc: Mapping[int, int]  # file index -> CRC-32 of this node's copy
    pieces: np.ndarray  # what this rank brought into the run: (file, offset, length, crc) rows


def sync(ctx: RunContext, place: Placement, moved: Transferred) -> None:
    """Make every file this node wrote durable (DestTree.sync_all: one syncfs, or an fdatasync each),
    once every rank has every byte (counted in the bcast stage)."""
    cluster = ctx.cluster
    t0 = cluster.clock()
    outcome: StageOutcome[None] = StageOutcome()
    with cluster.stage(outcome):
        ctx.io.end_journal()  # every byte is written: the journal's last append
        if place.leader and moved.here:
            files = moved.listed.listing.files
            ctx.dest_tree().sync_all([files[i].path for i in moved.here])
    ctx.explain_space(outcome, moved.needed)
    result = cluster.conclude(t0, outcome, stage="sync")
    ctx.record(figures.Finished(result.seconds))


def verify(ctx: RunContext, place: Placement, moved: Transferred) -> Mapping[int, str]:
    """Compare every file's MD5 across ranks and with the blob's Content-MD5 (exit 7 on a mismatch).

    Returns the MD5 every copy of each file has. ``--verify disk`` (the default mode):
    after the fsync, each leader reads every copy back from its disk (O_DIRECT, several
    files at once) and hashes it: a copy that the disk, the filesystem or another writer
    changed after it arrived differs from the bytes hashed in flight, which is checked
    too. ``--verify stream``: only the bytes hashed as they passed through the fan-out
    (files nobody transferred are read back).

    Each copy is also checked against the CRC-32 of the file's bytes as they came from the
    source (:func:`_against_source`): with or without a Content-MD5, on one node as on many.
    """
    cluster = ctx.cluster
    t0 = cluster.clock()
    outcome: StageOutcome[ReadBack] = StageOutcome()
    files = moved.listed.listing.files
    with cluster.stage(outcome):
        digests, crcs = _read_back(ctx, moved) if place.leader else ({}, {})  # one copy per node
        outcome.stats = ReadBack(digests, crcs, _pieces(ctx, moved))
    try:

        def record(result: StageResult[ReadBack]) -> None:  # the time, also when the copies differ
            ctx.record(figures.Verified(result.seconds))

        result = cluster.conclude(t0, outcome, record, stage="verify")
        seen = result.each(ReadBack({}, {}, np.zeros((0, 4), dtype=np.uint64)))
        against = _against_source(files, seen, place.topo.leaders)
        ctx.record(figures.Verified(result.seconds, against_source=against))
        verified = verdict(files, [(rank, seen[rank].md5) for rank in place.topo.leaders])
        ctx.record(figures.Verified(result.seconds, files=len(verified)))
    except VerifyError:
        if place.leader:  # a copy that does not match is not resumed from: the rerun moves it all
            journal.remove(ctx.dest_tree())
        raise
    return verified


def _read_back(ctx: RunContext, moved: Transferred) -> tuple[dict[int, str], dict[int, int]]:
    """A leader's copies read back (``--verify disk``: all; ``stream``: what no hash saw in
    flight), each copy's MD5 and CRC-32, and checked against what it hashed in flight."""
    files = moved.listed.listing.files
    have = moved.diff.have
    disk = ctx.cfg.verify == "disk"
    tree = ctx.dest_tree()
    written = set(moved.here)
    streamed = dict(moved.streamed_md5)
    for i in moved.diff.transfer:
        if files[i].size == 0:
            streamed[i] = EMPTY_MD5
    # Read back: everything this node holds (disk), or what was not streamed past
    # this rank. A file the schedule did not bring here (a subset) is not here.
    held = [i for i in range(len(files)) if i in written or have[i]]
    reread = [i for i in held if disk or i not in streamed]

    def hash_copy(i: int) -> tuple[str, int]:
        rel = files[i].path
        try:
            opener = tree.opener(rel, temp=i in written)
            return manifest.digests_of(opener, direct=disk and ctx.cfg.bcast_direct)
        except OSError as exc:
            where = tree.temp_shown(rel) if i in written else tree.shown(rel)
            raise VerifyError(f"cannot read the copy back: {exc.strerror or exc}", path=where) from None

    with ctx.cluster.abandonable():  # local work: a signal stops it at once
        both = dict(zip(reread, manifest.hash_files(hash_copy, reread), strict=True))
    digests = {i: md5 for i, (md5, _) in both.items()}
    # What was read back, else (--verify stream) what was hashed in flight.
    crcs = {i: c for i, c in moved.stream_crcs.items() if i in streamed}
    crcs.update((i, c) for i, (_, c) in both.items())
    for i, digest in streamed.items():
        if i not in digests:
            digests[i] = digest  # --verify stream
        elif digests[i] != digest:
            raise VerifyError(
                "the copy on disk differs from the bytes this rank received (changed after they "
                "arrived: by the disk, the filesystem or another writer)",
                path=tree.shown(files[i].path),
            )
    return digests, crcs


def _pieces(ctx: RunContext, moved: Transferred) -> np.ndarray:
    """What this rank brought into the run, each piece with the CRC-32 of its bytes as they came
    from the source (file, offset, length, crc): its downloaded blocks and local SOURCE reads,
    and a leader's kept blocks that were downloaded or read on its node (checked when the run
    began; --verify keeps no block another node sent: journal.load)."""
    pieces = list(moved.pieces.pieces)
    for i, keep in moved.diff.kept.items():
        pieces.extend((i, c.offset, c.length, c.crc) for c in keep.claims if c.source)
    return np.array(pieces, dtype=np.uint64).reshape(-1, 4)


def _against_source(files: Sequence[FileEntry], seen: Sequence[ReadBack], leaders: Sequence[int]) -> int:
    """Every copy read back (or hashed in flight) against the CRC-32 of its file's bytes as they
    came from the source, composed from every rank's pieces (core/crc.py) where they tile the
    file; VerifyError naming the file and nodes. Returns how many files were checked so."""
    pieces = (tuple(p) for rank in seen for p in rank.pieces.tolist())
    source, conflicting = expected([f.size for f in files], pieces)
    read_back = [(rank, seen[rank].crc) for rank in leaders]
    return against_source(files, read_back, source, conflicting)


def rename(ctx: RunContext, place: Placement, moved: Transferred) -> None:
    """Rename every file this node wrote to its final name, then fsync their directories."""
    cluster = ctx.cluster
    t0 = cluster.clock()
    outcome: StageOutcome[None] = StageOutcome()
    with cluster.stage(outcome):
        if place.leader and moved.here:
            tree = ctx.dest_tree()
            files = moved.listed.listing.files
            paths = [files[i].path for i in moved.here]
            tree.rename_all(paths)  # each directory walked once, 8 directories at a time
            tree.sync_dirs(paths)
    ctx.explain_space(outcome, moved.needed)
    result = cluster.conclude(t0, outcome, stage="rename")
    ctx.record(figures.Finished(result.seconds))


def record(ctx: RunContext, place: Placement, moved: Transferred, verified: Mapping[int, str]) -> None:
    """Update every node's manifest with what is now known to be in DEST.

    Copied files are the listed version. A skipped file is only known to be the listed
    version if its ETag or MD5 was checked; after a size check its entry stays as it was.
    """
    cluster = ctx.cluster
    outcome: StageOutcome[None] = StageOutcome()
    t0 = cluster.clock()
    files = moved.listed.listing.files
    have = moved.diff.have
    # Only what this node has now: a file the schedule did not bring here (a subset of
    # receivers) is not in its DEST.
    written = set(moved.here)
    copied = [i for i in moved.diff.transfer if i in written or have[i]]
    indices = range(len(files)) if ctx.cfg.compare in ("etag", "md5") else copied
    # A file without a Content-MD5 (a local SOURCE, a blob uploaded without one) is
    # recorded with the MD5 --verify found on every copy: --compare md5 can use it next time.
    known = [
        files[i]._replace(content_md5=verified[i]) if not files[i].content_md5 and i in verified else files[i]
        for i in indices
    ]
    with cluster.stage(outcome):
        if place.leader:
            tree = ctx.dest_tree()
            # What the compare found here (and the run left alone): no new look at its entries.
            present = {f.path: f.size for f in compress(files, have)}
            manifest.save(tree, known, manifest.load(tree), present)
            journal.remove(tree)  # every file is under its final name: nothing to resume
    cluster.note("record", t0)
    cluster.conclude(cluster.clock(), outcome)


def delete(ctx: RunContext, place: Placement, moved: Transferred) -> None:
    """``--delete``: each leader removes from its DEST what its diff's walk chose (dest/mirror.py).

    Called once every rank has passed the record stage's agreement: every node's copy is
    complete, durable and recorded, so a failed or stopped copy anywhere deletes nothing
    anywhere. A file changed, replaced or gone since the walk is left as it is (and a file
    put into DEST after the walk was never chosen). Its figures reach the report: the count
    and bytes over every node, and the paths up to mirror.REPORTED_PATHS.
    """
    cluster = ctx.cluster
    t0 = cluster.clock()
    outcome: StageOutcome[mirror.Removed] = StageOutcome()
    with cluster.stage(outcome):
        outcome.stats = mirror.Removed((), 0, ())
        if place.leader and moved.diff.stale:
            outcome.stats = mirror.remove(ctx.dest_tree(), moved.diff.stale)
    result = cluster.conclude(t0, outcome, stage="delete")
    removed = [removed for removed in result.each(mirror.Removed((), 0, ())) if removed.paths or removed.kept]
    paths = sorted({path for r in removed for path in r.paths})
    ctx.record(
        figures.Deleted(
            files=sum(len(r.paths) for r in removed),
            distinct=len(paths),
            bytes=sum(r.bytes for r in removed),
            copies=sum(1 for r in removed if r.paths),
            paths=tuple(paths[: mirror.REPORTED_PATHS]),
            kept=sum(len(r.kept) for r in removed),
        )
    )
