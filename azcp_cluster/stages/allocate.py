"""The schedule and the allocate stage: what each node receives, its files and buffers made up front.

``schedule_for`` cuts the plan into the leaders' transfers (a frozen :class:`Schedule`);
``allocate`` makes, in an agreement of its own and before any byte moves, every temporary
file this node writes, the download's buffers and the fan-out's slots (a :class:`Prepared`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from azcp_cluster.core.blocks import (
    MAX_SLOTS,
    Block,
    blocks_for,
    fanout_slots,
    keepable,
    pool_buffers_for,
    pool_bytes,
    requests_for,
)
from azcp_cluster.core.columns import distinct
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import InternalError
from azcp_cluster.core.model import Listing
from azcp_cluster.core.naming import JOURNAL_DIR
from azcp_cluster.core.packing import spread_chunk, spread_roots, transfer_schedule
from azcp_cluster.core.plan import Plan
from azcp_cluster.core.schedule import (
    DIRECT_MIN,
    Transfer,
    Transfers,
    files_of,
    files_written,
    max_length,
    payload,
)
from azcp_cluster.core.topology import workers_for
from azcp_cluster.core.waves import TAPER, StreamSizes, stream_sizes
from azcp_cluster.dest import journal
from azcp_cluster.dest.localfs import check_space, fs_error
from azcp_cluster.dest.localsource import source_file
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.download.cpus import allowed as allowed_cpus
from azcp_cluster.fanout.broadcast import Broadcaster
from azcp_cluster.fanout.chain import decide, transport_for
from azcp_cluster.fanout.transport import MpiTransport
from azcp_cluster.run.cluster import StageOutcome, StageResult
from azcp_cluster.stages.context import RunContext
from azcp_cluster.stages.setup import Placement, available_memory
from azcp_cluster.stages.survey import Diff, Listed

if TYPE_CHECKING:
    from azcp_cluster.download.writepool import WritePool


@dataclass(frozen=True)
class Schedule:
    """The transfers between the leaders, and the files they bring to this rank's node."""

    # schedule.Transfers (columns; each Transfer made when read), or any list of them
    transfers: Sequence[Transfer]
    receives: frozenset[int]  # files the schedule brings here (this and earlier rounds)

    @property
    def payload(self) -> int:
        """Bytes of file data in the transfers (not the alignment padding)."""
        return payload(self.transfers)

    @property
    def files(self) -> int:
        """Files with bytes in the transfers."""
        return files_of(self.transfers)


@dataclass(frozen=True)
class Prepared:
    """What the allocate stage made for the transfer stage."""

    broadcaster: Broadcaster | None  # leaders with something to fan out: slots mapped
    here: tuple[int, ...]  # the files this node writes (and later syncs, verifies, renames)


def schedule_for(ctx: RunContext, place: Placement, plan: Plan, earlier: Schedule | None = None) -> Schedule:
    """The transfers between the leaders for ``plan`` (a shard goes out from its owner's leader).

    ``earlier``: a first round's schedule, whose files this node still receives.
    """
    topo = place.topo
    if topo.groups == 1 and not ctx.local:
        # One node: the download writes every byte where it belongs and nobody receives, so
        # nothing is fanned out (no slots, no read-back). A local SOURCE still goes through
        # the fan-out: its reader's copy is the one the fan-out writes.
        c = plan.columns
        receives = set(distinct(c.file[c.length > 0]).tolist())
        transfers = Transfers.of([], 1)
    else:
        sizes = stream_sizes_for(ctx, place, plan)
        if sizes is not None:
            chunk = sizes.chunk
        elif ctx.cfg.fanout == "ibcast":  # a collective per slot: as few as the memory allows
            chunk = ctx.cfg.chunk
        else:  # several roots: every one of them in flight at once, round the ring
            c = plan.columns
            loads = np.zeros(topo.groups, dtype=np.int64)
            np.add.at(loads, np.asarray(topo.group_of, dtype=np.int64)[c.owner], c.length)
            roots = spread_roots(loads.tolist())
            chunk = spread_chunk(ctx.cfg.chunk, ctx.cfg.bcast_pipeline, roots, MAX_SLOTS)
        # Streamed: each root's last transfer tapered as its downloaders' last blocks are.
        tapered = TAPER if sizes is not None else None
        transfers = transfer_schedule(plan, chunk, topo.groups, root_of=topo.group_of, tapered=tapered)
        receives = files_written(transfers, place.group)
    if earlier is not None:
        receives |= earlier.receives
    return Schedule(transfers, frozenset(receives))


def stream_sizes_for(ctx: RunContext, place: Placement, plan: Plan) -> StreamSizes | None:
    """A streamed copy's transfer, block and in-flight sizes (core/waves.py: its shares land,
    and leave, in waves); None for a copy that does not stream (a local SOURCE, one node,
    --no-overlap, nothing to download). The same on every rank: from the largest share."""
    cfg = ctx.cfg
    loads = plan.loads()
    if ctx.local or not cfg.overlap or place.topo.groups == 1 or not any(loads):
        return None
    return stream_sizes(max(loads), cfg.chunk, cfg.block_size, cfg.concurrency)


def landing_unit(ctx: RunContext, place: Placement, plan: Plan, block_size: int) -> int:
    """A streamed download's blocks: as small as the transfers, each landing (and its transfer
    leaving) as soon as its bytes are written, while the downloader fetches consecutive ones in
    one ranged GET of up to ``block_size`` (blocks.requests_for). Landing whole 8 MiB GETs,
    four hosts in the box posted their transfers in bursts, the fabric idle between them."""
    sizes = stream_sizes_for(ctx, place, plan)
    return min(block_size, sizes.chunk) if sizes is not None else block_size


def keep_landed(ctx: RunContext, streamed: Config, mine: list[Block], unit: int) -> WritePool | None:
    """A streaming leader's download pool, told to keep what it writes for the fan-out to send
    from memory (``mine``: its blocks, ``unit``: its transfers' size); None if it downloads none.

    What this rank downloads in its own process lands in the pool's buffers: the pool keeps
    what the requests in flight and its spares leave, if that holds a whole transfer (worker
    processes' buffers are theirs: those blocks are read back from the disk)."""
    pool = ctx.write_pool if mine else None
    if pool is not None:
        in_flight = min(streamed.concurrency, len(requests_for(mine, streamed.block_size)))
        pool.keep_landed(keepable(pool.count, in_flight, -(-unit // pool.size)))
    return pool


def download_config(ctx: RunContext, place: Placement, plan: Plan, schedule: Schedule) -> Config:
    """The run's configuration as its download uses it: a streamed copy's block size and
    requests in flight (:func:`stream_sizes_for`), else the run's own. Streamed as
    transfer.move decides: with something to fan out."""
    sizes = stream_sizes_for(ctx, place, plan) if schedule.transfers else None
    if sizes is None:
        return ctx.cfg
    # --download-workers N asks for N processes, each with a request at least.
    in_flight = max(sizes.in_flight, ctx.cfg.download_workers or 1)
    return dataclasses.replace(ctx.cfg, block_size=sizes.block, concurrency=in_flight)


def writes_here(listing: Listing, diff: Diff, schedule: Schedule) -> tuple[int, ...]:
    """The transferred files this node does not have yet and the schedule brings it, or it kept
    from a stopped run (it writes and renames these); empty files are made on every node."""
    files = listing.files
    receives = schedule.receives
    kept = diff.kept
    return tuple(i for i in diff.transfer if not diff.have[i] and (files[i].size == 0 or i in receives or i in kept))


def allocate(ctx: RunContext, place: Placement, listed: Listed, diff: Diff, plan: Plan, schedule: Schedule) -> Prepared:
    """Create the temporary files, the download buffers and the broadcast slots, in an
    agreement of their own.

    Before any download: a node's other ranks write into the temporary files its leader
    creates here. A rank whose buffers do not fit fails here (Config.check_memory, at
    start-up, against the memory available), before anything is downloaded, and never stays
    out of the transfers the others have posted; the fan-out's slots beyond the first are
    reserved here and faulted in at first use (POPULATED_SLOTS).
    """
    here = writes_here(listed.listing, diff, schedule)
    if not diff.transfer:
        return Prepared(None, here)  # nothing to write: a rerun stays cheap
    cluster = ctx.cluster
    cfg = ctx.cfg
    t0 = cluster.clock()
    choose_fanout(ctx, place, schedule)
    # The leaders' choice, carried by the stage's agreement to rank 0, which need not be one.
    outcome = StageOutcome(stats={"fanout": ctx.fanout.as_dict()} if ctx.fanout is not None else {})
    broadcaster: Broadcaster | None = None
    mine = plan.owned_by(ctx.rank)
    with cluster.stage(outcome):
        # With worker processes, each has its own buffers and writers (workers.py).
        workers = download_workers(ctx, place, plan) if not ctx.local and mine else 1
        if workers > 1:
            from azcp_cluster.download.workers import WORKER_MEMORY

            cfg.check_memory(available_memory(), pool_bytes(cfg.concurrency) + workers * WORKER_MEMORY)
        if not ctx.local and mine and (workers == 1 or cfg.download_workers is None):  # auto starts alone
            from azcp_cluster.download.writepool import WritePool

            # Mapped now: the download stage then measures the transfer, not page faults.
            # No more buffers than this rank's requests can fill at once.
            fetch = download_config(ctx, place, plan, schedule)  # a streamed copy's blocks and requests
            blocks = len(blocks_for(mine, fetch.block_size))
            ctx.write_pool = WritePool(fetch, populate=True, buffers=pool_buffers_for(fetch.concurrency, blocks))
        if place.leader:
            files = listed.listing.files
            # Checked before anything is written, where the sizes are known.
            ctx.bytes_to_write = sum(files[i].size for i in here)
            later = made_on_arrival(ctx, place, listed.listing, plan, here, diff.kept)
            check_files_space(ctx, listed.listing, here)  # before anything is written
            start_journal(ctx, listed.listing, diff)  # before any file is made anew
            prepare_files(ctx, listed.listing, here, later, diff.kept, checked=True)
            broadcaster = make_broadcaster(ctx, place, listed, diff, schedule, later)
    ctx.explain_space(outcome)  # the files' blocks are reserved here: a full disk shows here first
    cluster.note("allocate", t0)
    cluster.conclude(cluster.clock(), outcome, lambda result: record_fanout(ctx, result))
    topo = place.topo
    if not ctx.local and any(not topo.is_leader(r) for r in topo.downloaders):
        # Some node has downloaders besides its leader: they get the files' identities.
        made = ctx.group_comm.bcast(ctx.tree.made if place.leader and ctx.tree is not None else None, root=0)
        if mine and not place.leader:
            tree = ctx.dest_tree()
            tree.adopt(made or {})  # DEST exists now: its leader made it
            if cfg.resume:  # this rank writes into the node's files: its own journal
                fd = journal.open_for(tree, ctx.group_comm.Get_rank())
                if fd is not None:
                    ctx.journal = journal.Journal(tree, fd, listed.listing.files, ctx.origin)
    return Prepared(broadcaster, here)


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
        ctx.journal = journal.Journal(tree, fd, listing.files, ctx.origin, first_id=len(diff.kept))


def download_workers(ctx: RunContext, place: Placement, plan: Plan) -> int:
    """How many worker processes make this rank's ranged GETs (1: the rank itself; topology.workers_for).

    ``--download-workers N``: N. Auto: the most it may start, should they pay (workers.AutoDownloader
    decides while the rank downloads). Never more than ``--concurrency``.
    """
    share = sum(s.length for s in plan.owned_by(ctx.rank))
    cpus = len(allowed_cpus())
    return min(workers_for(ctx.cfg.download_workers, cpus, cpus_sharing(place), share), ctx.cfg.concurrency)


def cpus_sharing(place: Placement) -> int:
    """How many downloading ranks share this rank's CPUs.

    A rank bound to some of the machine's CPUs (Slurm's ``--cpus-per-task``, ``taskset``) has
    them to itself; one that may use them all shares them with the host's other downloaders.
    """
    bound = len(allowed_cpus()) < (os.cpu_count() or 1)
    return 1 if bound else place.downloaders_on_host


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


def choose_fanout(ctx: RunContext, place: Placement, schedule: Schedule) -> None:
    """Leaders, once per run, before the stage that maps the slots: how the fan-out moves its
    bytes (``--fanout``; auto may probe the fabric, a collective of the leaders, so it runs
    here, where every leader is, never inside a stage one of them may have left)."""
    if not place.leader or not schedule.transfers or ctx.fanout is not None:
        return
    cfg = ctx.cfg
    transfers = schedule.transfers
    ctx.fanout = decide(
        MpiTransport(ctx.node_comm), cfg.fanout, payload(transfers), cfg.fanout_piece, max_length(transfers)
    )
    ctx.report.fanout = ctx.fanout.as_dict()


def record_fanout(ctx: RunContext, result: StageResult) -> None:
    """The fan-out's transport in the report, as the leaders chose it (rank 0 may be none)."""
    chosen = [stats["fanout"] for stats in result.stats if stats.get("fanout")]
    if chosen and not ctx.report.fanout:
        ctx.report.fanout = chosen[0]


# Fan-out slots mapped in this stage; the others at first use. The first transfer's slot is
# ready when the fan-out starts; the rest fault in while it goes, on a fabric-bound stage
# with CPU to spare (eight hosts in the box: the stage's slot mapping 0.21 -> 0.04 s).
POPULATED_SLOTS = 1


def make_broadcaster(
    ctx: RunContext, place: Placement, listed: Listed, diff: Diff, schedule: Schedule, later: Sequence[int] = ()
) -> Broadcaster | None:
    """Leaders: the fan-out engine for ``schedule``, its slots mapped now, and its node writer
    (``ctx.fanout_writer``, closed by the stage that fans out)."""
    transfers = schedule.transfers
    if not transfers:
        return None
    cfg = ctx.cfg
    reads = ctx.local and ctx.rank in place.readers
    if ctx.fanout is None:
        raise InternalError("the fan-out's transport was not chosen before its stage (choose_fanout)")
    threads, name = cfg.bcast_writers, "azcp-bcast-writer"
    slot = max_length(transfers)
    shared = cfg.overlap and ctx.write_pool is not None
    if shared:
        # Streaming, and this leader downloads in its own process: its download writes
        # through the same writer, one set of threads for both (diskwriter.py).
        from azcp_cluster.download.writepool import WRITER_THREADS

        threads, name = WRITER_THREADS + cfg.bcast_writers, "azcp-writer"
    ctx.fanout_writer = NodeWriter(
        listed.listing.files,
        ctx.dest_tree(),
        threads,
        on_arrival=frozenset(later),
        journal=ctx.journal.written if ctx.journal is not None else None,
        name=name,
    )
    if shared:
        ctx.download_writer = ctx.fanout_writer
    return Broadcaster(
        transport_for(MpiTransport(ctx.node_comm), ctx.fanout),
        listed.listing.files,
        ctx.dest_tree(),
        slot,  # no slot larger than the largest transfer
        ctx.fanout_writer,
        pipeline=fanout_slots(cfg.bcast_pipeline, cfg.chunk, slot, len(transfers)),  # in the same memory
        populated=POPULATED_SLOTS,
        writers=cfg.bcast_writers,
        direct=cfg.bcast_direct,
        have=list(diff.have),
        verify=bool(cfg.verify),
        source_of=read_from_source(ctx, listed, diff) if reads else None,
        source_pieces=ctx.source_pieces.add if cfg.verify and reads else None,
        stream_crcs=ctx.stream_crcs if cfg.verify else None,
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
