"""The allocate stage: the transfer's shape decided once, this node's files and buffers made up front.

``allocate`` decides the :class:`~azcp_cluster.stages.shape.TransferShape` and makes, in an
agreement of its own and before any byte moves, every temporary file this node writes, the
download's buffers and writer, the block journal and the fan-out's slots, each handed to the
rank's :class:`~azcp_cluster.stages.nodeio.NodeIO`; it returns a frozen :class:`Prepared`,
all the transfer stage needs. ``resend`` prepares a second round of sending, for a local
SOURCE's files that changed while they were read (pipeline.execute runs it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from azcp_cluster.core.blocks import blocks_for, fanout_slots, pool_buffers_for, pool_bytes
from azcp_cluster.core.chain import FanoutChoice
from azcp_cluster.core.crc import SourcePieces
from azcp_cluster.core.errors import InternalError
from azcp_cluster.core.model import FileEntry, Listing
from azcp_cluster.core.naming import JOURNAL_DIR
from azcp_cluster.core.plan import Plan, Shard, plan_transfers
from azcp_cluster.core.schedule import DIRECT_MIN, max_length, payload
from azcp_cluster.dest import journal
from azcp_cluster.dest.localfs import check_space, fs_error
from azcp_cluster.dest.localsource import restat, source_file
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.fanout.chain import decide as decide_fanout
from azcp_cluster.fanout.chain import transport_for
from azcp_cluster.fanout.driver import FanOutDriver
from azcp_cluster.fanout.transport import MpiTransport
from azcp_cluster.run import figures
from azcp_cluster.run.cluster import StageOutcome, StageResult, error_from_payload, error_payload
from azcp_cluster.stages import shape as shapes
from azcp_cluster.stages.context import RunContext
from azcp_cluster.stages.scheduling import Schedule, schedule_for, writes_here
from azcp_cluster.stages.setup import Placement, available_memory, ranks_here
from azcp_cluster.stages.shape import TransferShape
from azcp_cluster.stages.survey import Diff, Listed

if TYPE_CHECKING:
    from azcp_cluster.stages.transfer import Transferred


@dataclass(frozen=True)
class Prepared:
    """What the allocate stage made for the transfer stage: all it needs, decided once."""

    listed: Listed
    diff: Diff
    plan: Plan
    schedule: Schedule
    shape: TransferShape
    driver: FanOutDriver | None  # a rank of a chain with something to fan out (leaders; every lane with rails)
    here: tuple[int, ...]  # the files this node writes (and later syncs, verifies, renames)
    # --verify: what this rank brings into the run (downloaded blocks, a local SOURCE's reads)
    # with the CRC-32 of the bytes as they came, and the CRC-32 of each file its fan-out
    # hashed in flight; finish.verify checks every copy against the first (core/crc.py).
    # Filled by the transfer stage, carried by every round of it.
    pieces: SourcePieces = field(default_factory=SourcePieces)
    stream_crcs: dict[int, int] = field(default_factory=dict)
    resent: bool = False  # a second round, for files that changed while they were read
    lane: int = 0  # the rail whose chain this rank's fan-out is in (setup.Placement.lane)

    @property
    def needed(self) -> int:
        """Bytes of the files this node writes (for a full-disk message)."""
        files = self.listed.listing.files
        return sum(files[i].size for i in self.here)


def allocate(ctx: RunContext, place: Placement, listed: Listed, diff: Diff, plan: Plan, schedule: Schedule) -> Prepared:
    """Decide the transfer's shape; create the temporary files, the download's buffers and
    writer, the journal and the fan-out's slots, in an agreement of their own.

    Before any download: a node's other ranks write into the temporary files its leader
    creates here. A rank whose buffers do not fit fails here (Config.check_memory, at
    start-up, against the memory available), before anything is downloaded, and never stays
    out of the transfers the others have posted; the fan-out's slots beyond the first are
    reserved here and faulted in at first use (POPULATED_SLOTS).
    """
    here = writes_here(listed.listing, diff, schedule)
    shape = shapes.decide(ctx.cfg, ctx.local, ctx.rank, place, plan, schedule.anywhere)
    if not diff.transfer:
        # Nothing to write: a rerun stays cheap.
        return Prepared(listed, diff, plan, schedule, shape, None, here, lane=place.lane)
    cluster = ctx.cluster
    t0 = cluster.clock()
    shape = dataclasses.replace(shape, fanout=choose_fanout(ctx, place, schedule))
    # The leaders' choice, carried by the stage's agreement to rank 0, which need not be one.
    outcome = StageOutcome(stats=shape.fanout.as_dict() if shape.fanout is not None else None)
    driver: FanOutDriver | None = None
    pieces = SourcePieces()
    stream_crcs: dict[int, int] = {}
    mine = plan.owned_by(ctx.rank)
    with cluster.stage(outcome):
        _download_buffers(ctx, shape, mine)
        if place.leader:
            # With several rails, each lane writes what its chain brings: every file made here first.
            later = made_on_arrival(ctx, place, listed.listing, plan, here, diff.kept) if place.rails == 1 else []
            check_files_space(ctx, listed.listing, here)  # before anything is written
            start_journal(ctx, listed.listing, diff)  # before any file is made anew
            prepare_files(ctx, listed.listing, here, later, diff.kept, checked=True)
            driver = make_driver(ctx, place, listed, diff, schedule, shape, pieces, stream_crcs, later)
    # The files' blocks are reserved here: a full disk shows here first.
    ctx.explain_space(outcome, sum(listed.listing.files[i].size for i in here))
    cluster.note("allocate", t0)
    cluster.conclude(cluster.clock(), outcome, lambda result: record_fanout(ctx, result))
    _hand_to_downloaders(ctx, place, listed, mine)
    if place.rails > 1:  # every other lane's chain: its driver, once it knows the files' identities
        lane: StageOutcome[None] = StageOutcome()
        with cluster.stage(lane):
            if not place.leader:
                driver = make_driver(ctx, place, listed, diff, schedule, shape, pieces, stream_crcs)
        ctx.explain_space(lane, sum(listed.listing.files[i].size for i in here))
        cluster.conclude(cluster.clock(), lane)
    _download_writer(ctx, listed.listing.files, shape)  # after the files' identities came
    return Prepared(listed, diff, plan, schedule, shape, driver, here, pieces, stream_crcs, lane=place.lane)


def _download_buffers(ctx: RunContext, shape: TransferShape, mine: Sequence[Shard]) -> None:
    """A rank that downloads in its own process: its buffers, mapped now (the download stage then
    measures the transfer, not page faults), no more than its requests can fill at once. With
    worker processes, each has its own buffers and writers (workers.py): their memory is checked."""
    cfg = ctx.cfg
    if ctx.local or not mine:
        return
    if shape.workers > 1:
        from azcp_cluster.download.workers import WORKER_MEMORY

        cfg.check_memory(
            available_memory(), pool_bytes(cfg.concurrency) + shape.workers * WORKER_MEMORY, ranks_here(ctx)
        )
    if shape.workers == 1 or cfg.download_workers is None:  # auto starts alone
        from azcp_cluster.download.writepool import WritePool

        fetch = shape.fetch  # a streamed copy's blocks and requests
        blocks = len(blocks_for(mine, fetch.block_size))
        ctx.io.pool = WritePool(fetch, populate=True, buffers=pool_buffers_for(fetch.concurrency, blocks))


def _download_writer(ctx: RunContext, files: Sequence[FileEntry], shape: TransferShape) -> None:
    """A rank with download buffers: the node writer its download writes through (a streaming
    leader's is its fan-out's, made with the driver: one set of threads for both)."""
    from azcp_cluster.download.writepool import WRITER_THREADS

    io = ctx.io
    if io.pool is not None and io.download_writer is None:
        io.download_writer = NodeWriter(files, ctx.dest_tree(), WRITER_THREADS)


def _hand_to_downloaders(ctx: RunContext, place: Placement, listed: Listed, mine: Sequence[Shard]) -> None:
    """Where a node has ranks besides its leader that write into its files (downloaders, or every
    lane's chain with several rails): they get the identities of the files it made (they write
    into no other file), and each, with --resume, a block journal of its own."""
    topo = place.topo
    if place.rails == 1 and (ctx.local or all(topo.is_leader(r) for r in topo.downloaders)):
        return
    tree = ctx.tree
    made = ctx.group_comm.bcast(tree.made if place.leader and tree is not None else None, root=0)
    if (mine or place.rails > 1) and not place.leader:
        tree = ctx.dest_tree()
        tree.adopt(made or {})  # DEST exists now: its leader made it
        if ctx.cfg.resume:  # this rank writes into the node's files: its own journal
            fd = journal.open_for(tree, ctx.group_comm.Get_rank())
            if fd is not None:
                ctx.io.journal = journal.Journal(tree, fd, listed.listing.files, ctx.origin)


def start_journal(ctx: RunContext, listing: Listing, diff: Diff) -> None:
    """Leaders: the journal directory rewritten to hold what this run keeps, then this
    leader's journal running (none with --no-resume: a stopped run's journal is removed,
    since its files are made anew)."""
    tree = ctx.dest_tree()
    if not ctx.cfg.resume:
        journal.remove(tree)
        return
    try:
        fd = journal.begin(tree, listing.files, diff.kept, ctx.origin)
    except OSError as exc:  # a full or failing disk: named like any other write to DEST
        raise fs_error(exc, tree.shown(JOURNAL_DIR), "write the block journal") from None
    if fd is not None:
        ctx.io.journal = journal.Journal(tree, fd, listing.files, ctx.origin, first_id=len(diff.kept))


def prepare_files(
    ctx: RunContext,
    listing: Listing,
    indices: Sequence[int],
    later: Sequence[int] = (),
    kept: Mapping[int, journal.Kept] | None = None,
    checked: bool = False,
) -> None:
    """Leaders: check the space (unless ``checked`` already), then make the temporary files of
    ``indices`` anew at full size (those in ``later`` are made by the broadcast's writers, see
    DestTree.prepare_all), but for those ``kept`` from a stopped run: their files stay,
    known by their identity."""
    tree = ctx.dest_tree()
    kept = kept or {}
    entries = [(listing.files[i].path, listing.files[i].size) for i in indices]
    if not checked:
        check_files_space(ctx, listing, indices)
    tree.prepare_all(
        [e for i, e in zip(indices, entries, strict=True) if i not in kept],
        later=[listing.files[i].path for i in later],
    )
    tree.adopt({listing.files[i].path: kept[i].identity for i in indices if i in kept})


def check_files_space(ctx: RunContext, listing: Listing, indices: Sequence[int]) -> None:
    """Leaders: DEST has room for the files of ``indices`` (a leftover or kept temporary file's
    blocks count as its own), or a LocalFSError naming what is needed and free."""
    entries = [(listing.files[i].path, listing.files[i].size) for i in indices]
    check_space(ctx.dest, ctx.dest_tree().space_needed(entries))


def made_on_arrival(
    ctx: RunContext,
    place: Placement,
    listing: Listing,
    plan: Plan,
    missing: Sequence[int],
    kept: Mapping[int, journal.Kept] | None = None,
) -> list[int]:
    """The small files this node only receives (no rank of the node downloads into them):
    their writer creates them when their bytes arrive, one open each instead of two (not
    one kept from a stopped run: it stands there already)."""
    group_of = place.topo.group_of
    # A local SOURCE's plan names its readers as owners: they read it, nobody downloads.
    node = [rank for rank, group in enumerate(group_of) if group == place.group]
    downloaded = set() if ctx.local else plan.downloaded_files(node)
    files = listing.files
    kept = kept or {}
    return [i for i in missing if 0 < files[i].size < DIRECT_MIN and i not in downloaded and i not in kept]


def choose_fanout(
    ctx: RunContext, place: Placement, schedule: Schedule, chosen: FanoutChoice | None = None
) -> FanoutChoice | None:
    """Leaders, once per run, before the stage that maps the slots: how the fan-out moves its
    bytes (``--fanout``; auto may probe the fabric, a collective of the leaders, so it runs
    here, where every leader is, never inside a stage one of them may have left). ``chosen``:
    the first round's choice, kept for a second."""
    if not place.fans_out or not schedule.transfers or chosen is not None:
        return chosen
    cfg = ctx.cfg
    transfers = schedule.transfers
    fanout = decide_fanout(
        MpiTransport(ctx.node_comm), cfg.fanout, payload(transfers), cfg.fanout_piece, max_length(transfers)
    )
    return fanout


def record_fanout(ctx: RunContext, result: StageResult[dict[str, object]]) -> None:
    """The fan-out's transport in the report, as the leaders chose it (rank 0 may be none)."""
    chosen = [choice for choice in result.stats if choice]
    if chosen:
        ctx.record(figures.FanoutChosen(chosen[0]))


# Fan-out slots mapped in this stage; the others at first use. The first transfer's slot is
# ready when the fan-out starts; the rest fault in while it goes, on a fabric-bound stage
# with CPU to spare (docs/benchmarks.md: what mapping them all cost).
POPULATED_SLOTS = 1


def make_driver(
    ctx: RunContext,
    place: Placement,
    listed: Listed,
    diff: Diff,
    schedule: Schedule,
    shape: TransferShape,
    pieces: SourcePieces,
    stream_crcs: dict[int, int],
    later: Sequence[int] = (),
) -> FanOutDriver | None:
    """A rank of a chain (the leaders; with several rails, every lane): the fan-out engine for
    ``schedule``, its slots mapped now, and its node writer (the node I/O's ``fanout_writer``,
    ended by the stage that fans out)."""
    transfers = schedule.transfers
    if not transfers:
        return None
    cfg = ctx.cfg
    io = ctx.io
    reads = ctx.local and ctx.rank in place.owners
    if shape.fanout is None:
        raise InternalError("the fan-out's transport was not chosen before its stage (choose_fanout)")
    threads, name = cfg.bcast_writers, "azcp-fanout-writer"
    slot = max_length(transfers)
    shared = shape.streamed and io.pool is not None
    if shared:
        # Streaming, and this leader downloads in its own process: its download writes
        # through the same writer, one set of threads for both (diskwriter.py).
        from azcp_cluster.download.writepool import WRITER_THREADS

        threads, name = WRITER_THREADS + cfg.bcast_writers, "azcp-writer"
    io.fanout_writer = NodeWriter(
        listed.listing.files,
        ctx.dest_tree(),
        threads,
        on_arrival=frozenset(later),
        journal=io.journal.written if io.journal is not None else None,
        name=name,
    )
    if shared:
        io.download_writer = io.fanout_writer
    return FanOutDriver(
        transport_for(MpiTransport(ctx.node_comm), shape.fanout),
        listed.listing.files,
        ctx.dest_tree(),
        slot,  # no slot larger than the largest transfer
        io.fanout_writer,
        pipeline=fanout_slots(cfg.bcast_pipeline, cfg.chunk, slot, len(transfers)),  # in the same memory
        populated=POPULATED_SLOTS,
        writers=cfg.bcast_writers,
        direct=cfg.bcast_direct,
        have=list(diff.have),
        verify=bool(cfg.verify) and place.rails == 1,  # a lane hashes a part of a file: no whole MD5
        source_of=read_from_source(ctx, listed, diff) if reads else None,
        source_pieces=pieces.add if cfg.verify and reads else None,
        stream_crcs=stream_crcs if cfg.verify and place.rails == 1 else None,
        stop_requested=ctx.cluster.interrupted,
    )


def read_from_source(ctx: RunContext, listed: Listed, diff: Diff) -> Callable[[int], str | None]:
    """For a reader of a local SOURCE: where each file it lacks is read from."""
    have = diff.have
    files = listed.listing.files

    def where(index: int) -> str | None:
        if have[index]:
            return None  # sent from the reader's own complete copy
        return source_file(ctx.source_root, files[index].name, listed.single_file)

    return where


def _forget(ctx: RunContext, paths: list[str]) -> None:
    """Every rank that journals the node's files (the leader, and each lane or downloader that
    wrote into them) records what it wrote of ``paths`` and then that none of it counts, in an
    agreement, before the leader makes them anew: a lane's journal syncing a file the leader
    has replaced would find another file there."""
    outcome: StageOutcome[None] = StageOutcome()
    with ctx.cluster.stage(outcome):
        if ctx.io.journal is not None:
            ctx.io.journal.drop(paths)
    ctx.cluster.conclude(ctx.cluster.clock(), outcome)


def resend(ctx: RunContext, place: Placement, moved: Transferred, first: Prepared) -> Prepared:
    """A second round of sending: the local SOURCE's files that changed while they were read, as they are now.

    The reader looks at them again (their new size and time); every node makes their
    temporary files anew and receives them again (a torn copy never reaches a final name:
    the rename comes after). What the first read of them brought counts no more.
    """
    cluster = ctx.cluster
    changed = list(moved.changed)
    listed = moved.listed
    outcome: StageOutcome[None] = StageOutcome()
    fresh: list[FileEntry] = []
    if ctx.rank == place.reader:
        with cluster.stage(outcome):
            fresh = [restat(ctx.source_root, listed.listing.files[i], listed.single_file) for i in changed]
    message = (fresh, error_payload(outcome.error) if outcome.error else None)
    fresh, failure = cluster.bcast_object(message, root=place.reader)
    if failure is not None:
        raise error_from_payload(failure)
    files = list(listed.listing.files)
    for index, entry in zip(changed, fresh, strict=True):
        files[index] = entry
    listed = dataclasses.replace(listed, listing=dataclasses.replace(listed.listing, files=tuple(files)))
    ctx.record(figures.Resent(listed.listing.total_bytes))
    diff = moved.diff.without(changed)  # a copy some node had is of another version now
    topo = place.topo
    lacking = set(changed)
    holders = [[] if i in lacking else list(topo.leaders) for i in range(len(files))]
    plan = plan_transfers(
        [f.size for f in files], holders, topo.size, ctx.cfg.shard_size, owners=[place.reader], copies=topo.groups
    )
    schedule = schedule_for(ctx.cfg, ctx.local, place, plan, earlier=first.schedule)
    fanout = choose_fanout(ctx, place, schedule, first.shape.fanout)
    shape = shapes.decide(ctx.cfg, ctx.local, ctx.rank, place, plan, schedule.anywhere, fanout)
    first.pieces.drop(changed)  # read again: what the first read saw does not count
    _forget(ctx, [files[i].path for i in changed])
    outcome = StageOutcome()
    driver: FanOutDriver | None = None
    with cluster.stage(outcome):
        if place.leader:
            prepare_files(ctx, listed.listing, changed)
            driver = make_driver(ctx, place, listed, diff, schedule, shape, first.pieces, first.stream_crcs)
    here = writes_here(listed.listing, diff, schedule)
    ctx.explain_space(outcome, sum(files[i].size for i in here))
    cluster.conclude(cluster.clock(), outcome)
    return Prepared(
        listed, diff, plan, schedule, shape, driver, here, first.pieces, first.stream_crcs, True, place.lane
    )
