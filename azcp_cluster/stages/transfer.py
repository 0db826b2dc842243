"""The transfer stage: download and fan out (at once, streaming, or one after the other).

``move`` runs one round as the allocate stage shaped it (``Prepared``; this module decides
nothing of the shape) and returns a frozen :class:`Transferred`: what every node now holds
under temporary names, the MD5s hashed in flight, and the local files that changed while
they were read (pipeline.execute sends those again). The roles and the streaming protocol
are in streaming.py and docs/architecture.md ("Streaming").
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from azcp_cluster.core.config import Config
from azcp_cluster.core.crc import SourcePieces
from azcp_cluster.core.errors import AzcpError, InternalError, SourceError
from azcp_cluster.core.plan import Plan
from azcp_cluster.core.waves import TAPER
from azcp_cluster.dest.localsource import source_file
from azcp_cluster.fanout.events import StageHooks
from azcp_cluster.run import figures
from azcp_cluster.run.cluster import StageOutcome, StageResult, as_azcp_error
from azcp_cluster.run.figures import RankDownload, RankFanout
from azcp_cluster.run.progress import Progress
from azcp_cluster.stages.allocate import Prepared
from azcp_cluster.stages.context import RunContext
from azcp_cluster.stages.setup import Placement
from azcp_cluster.stages.survey import Diff, Listed

if TYPE_CHECKING:
    from azcp_cluster.core.blocks import Block
    from azcp_cluster.download.downloader import Downloader
    from azcp_cluster.download.fetcher import DownloadStats, Fetcher, LandingSink
    from azcp_cluster.download.workers import WorkerDownloader
    from azcp_cluster.download.writepool import WritePool
    from azcp_cluster.fanout.streaming import LandingFeed, Streamed


@dataclass(frozen=True)
class Transferred:
    """Every byte on every node that needs it, under temporary names (agreed by all ranks)."""

    listed: Listed  # as read last (a local file that changed while it was read: as sent again)
    diff: Diff
    here: tuple[int, ...]  # the files this node wrote
    streamed_md5: Mapping[int, str]  # --verify: file index -> MD5 hashed in flight on this rank
    # --verify: what this rank brought into the run with the CRC-32 of its bytes as they came,
    # and the CRC-32 of each file its fan-out hashed in flight (allocate.Prepared).
    pieces: SourcePieces
    stream_crcs: Mapping[int, int]
    changed: tuple[int, ...] = ()  # local SOURCE files that changed while they were read: sent again
    resent: bool = False  # this was the second round of sending

    @property
    def needed(self) -> int:
        """Bytes of the files this node writes (for a full-disk message)."""
        files = self.listed.listing.files
        return sum(files[i].size for i in self.here)


@dataclass(frozen=True)
class FannedOut:
    """What one fan-out round found (agreed by all ranks)."""

    changed: tuple[int, ...]  # local SOURCE files that changed while they were read
    digests: Mapping[int, str]  # --verify: file index -> MD5 hashed in flight on this rank


def move(ctx: RunContext, place: Placement, prepared: Prepared, earlier: Transferred | None = None) -> Transferred:
    """Download this rank's share and fan every byte out, as ``prepared`` (the allocate stage) shaped it.

    ``earlier``: the first round, when this one sends again what changed while it was read
    (pipeline.execute); its digests stand for the files not sent again.
    """
    if prepared.shape.streamed:
        done = stream(ctx, place, prepared)
    else:
        if not ctx.local:
            download(ctx, place, prepared)
        done = fan_out(ctx, place, prepared)
    digests = {**(earlier.streamed_md5 if earlier is not None else {}), **done.digests}
    return Transferred(
        prepared.listed,
        prepared.diff,
        prepared.here,
        digests,
        prepared.pieces,
        prepared.stream_crcs,
        done.changed,
        prepared.resent,
    )


def changed_twice(ctx: RunContext, moved: Transferred) -> SourceError:
    """The error for a local file that changed again while it was read a second time (exit 5)."""
    listed = moved.listed
    name = listed.listing.files[moved.changed[0]].name
    return SourceError(
        "the file changed while it was read, twice (it is being written to); copy it once it is complete",
        path=source_file(ctx.source_root, name, listed.single_file),
    )


def download(ctx: RunContext, place: Placement, prepared: Prepared) -> None:
    """Every downloader fetches its shards into its node's temporary files."""
    from azcp_cluster.core.blocks import blocks_for

    cluster = ctx.cluster
    t0 = cluster.clock()
    outcome: StageOutcome[RankDownload] = StageOutcome()
    mine = prepared.plan.owned_by(ctx.rank)
    progress = Progress("download", sum(s.length for s in mine), ctx.show_progress)
    with cluster.stage(outcome):
        if mine:
            fetcher = downloader(ctx, place, prepared, progress.add, ctx.cluster.peer_failed)
            try:
                fetcher.run(blocks_for(mine, prepared.shape.fetch.block_size))
            finally:  # what it did, also when it failed: the report has the figures so far
                outcome.stats = download_figures(fetcher.stats)
    progress.close()
    ctx.io.end_download()  # its memory is not needed by the fan-out
    ctx.explain_space(outcome, prepared.needed)
    if outcome.error is not None:
        cluster.signal_failure(outcome)

    def record(result: StageResult[RankDownload]) -> None:
        ranks = tuple(result.each(RankDownload()))
        ctx.record(figures.Downloaded(result.seconds, ranks))
        ctx.warn_direct([rank.refused for rank in ranks])

    cluster.conclude(t0, outcome, record, stage="download")


def download_figures(stats: DownloadStats) -> RankDownload:
    """One rank's download counters, as its stage outcome carries them to the report."""
    return RankDownload(
        stats.bytes, stats.retries, dict(stats.retry_causes), stats.direct_refused or None, tuple(stats.worker_bytes)
    )


def downloader(
    ctx: RunContext,
    place: Placement,
    prepared: Prepared,
    progress: Callable[[int], None] | None,
    peer_failed: Callable[[], bool],
    notice: Callable[[Block], None] | None = None,
) -> Fetcher:
    """This rank's downloader for its share of the plan (paced by its share of --max-bandwidth): in the
    rank itself, on ``--download-workers`` processes, or, auto, in the rank until it finds that processes
    would shorten the copy (workers.py). Its configuration is the shape's (a streamed copy's block size
    and requests in flight).

    Its landing sink, composed here once: each block's bytes to ``progress`` (if any), the block to this rank's journal
    (if any), to ``notice`` (streaming), and with ``--verify`` its CRC to the source pieces. It stops once
    ``peer_failed()``."""
    from azcp_cluster.download import workers as worker_processes
    from azcp_cluster.download.fetcher import LandingSink

    shape = prepared.shape
    io = ctx.io
    hashes = prepared.pieces.add if shape.fetch.verify else None
    sink = LandingSink(progress, io.journal.written if io.journal is not None else None, notice, hashes=hashes)
    makers = _Makers(ctx, place, prepared, sink, peer_failed)
    workers = shape.workers
    if workers > 1 and shape.fetch.download_workers is None:
        return worker_processes.AutoDownloader(
            makers.alone, makers.processes, workers, shape.cpus_sharing, release=io.free_buffers
        )
    return makers.processes(workers) if workers > 1 else makers.alone()


class _Makers:
    """How a rank's downloader is made: in the rank itself (:meth:`alone`) or on worker processes."""

    def __init__(
        self, ctx: RunContext, place: Placement, prepared: Prepared, sink: LandingSink, peer_failed: Callable[[], bool]
    ) -> None:
        self.ctx, self.place, self.sink, self.peer_failed = ctx, place, sink, peer_failed
        self.cfg = prepared.shape.fetch
        self.files = prepared.listed.listing.files
        self.rate = _rate(self.cfg, prepared.plan)
        assert place.auth is not None
        self.auth = place.auth

    def processes(self, count: int) -> WorkerDownloader:
        """``count`` worker processes, writing the temporary files whose identities the rank hands them."""
        from azcp_cluster.download.workers import WorkerDownloader

        files, tree = self.files, self.ctx.dest_tree()
        return WorkerDownloader(
            files,
            self.ctx.dest,
            tree.made,
            lambda i: files[i].path,
            self.auth,
            self.cfg,
            count,
            peer_failed=self.peer_failed,
            sink=self.sink,
            rate=self.rate,
            proxy=self.place.proxy,
        )

    def alone(self, handover: Callable[[], bool | None] | None = None) -> Downloader:
        """The rank itself, through the download's buffers and node writer that allocate made."""
        from azcp_cluster.core.throttle import Pacer
        from azcp_cluster.download.downloader import Downloader

        io = self.ctx.io
        pacer = Pacer.for_rate(self.rate, self.ctx.cluster.clock) if self.rate is not None else None
        if io.download_writer is None:
            raise InternalError("the download's writer was not made before its stage (allocate)")
        return Downloader(
            self.files,
            self.ctx.dest_tree(),
            self.auth,
            self.cfg,
            peer_failed=self.peer_failed,
            sink=self.sink,
            pacer=pacer,
            pool=io.pool,
            writer=io.download_writer,
            proxy=self.place.proxy,
            handover=handover,
        )


def stream(ctx: RunContext, place: Placement, prepared: Prepared) -> FannedOut:
    """Download and fan out at once: a transfer goes out as soon as its bytes are on its root's node.

    One failure signal for the whole stage: a rank that fails signals the others (their
    downloads stop, their fan-outs stop waiting for bytes) and the fan-out's agreements
    stop every leader at the same transfer. Reported as both stages: ``download`` until
    the last byte landed, ``bcast`` the whole stage (they overlap).
    """
    from azcp_cluster.core.blocks import Block, node_blocks
    from azcp_cluster.fanout.streaming import LandingFeed, Streamed, lead, notify_while_downloading

    cluster = ctx.cluster
    rank = ctx.rank
    t0 = cluster.clock()
    plan, schedule, driver = prepared.plan, prepared.schedule, prepared.driver
    transfers, lanes = schedule.transfers, place.rails > 1  # transfers: columns, each made when read
    unit = prepared.shape.unit  # as small as the transfers: each leaves as soon as its bytes landed
    blocks, landing = node_blocks(transfers, plan, place.group, _landing_here(place, rank), unit, TAPER)
    mine = [Block(*blocks.blocks[i]) for i in blocks.of_rank.get(rank, ())]
    index = {(f, o): i for i, (f, o, _) in enumerate(blocks.blocks)}
    progress = _transfer_progress(ctx, prepared)
    outcome: StageOutcome[RankFanout] = StageOutcome()
    feed: LandingFeed | None = None
    digests: dict[int, str] = {}

    def since() -> float:
        return cluster.clock() - t0

    made: list[Fetcher] = []  # this rank's, once made: its figures, also after a failure
    fanned = FanOutTally(progress.add)

    def make_downloader(notice: Callable[[Block], None], peer_failed: Callable[[], bool]) -> Fetcher:
        made.append(downloader(ctx, place, prepared, None, peer_failed, notice))  # progress: the fan-out's
        return made[-1]

    with cluster.stage(outcome):
        done = Streamed(0.0)
        if place.fans_out and driver is not None:
            others = [] if lanes else _notifying(place, rank, blocks.of_rank)
            feed = here = LandingFeed(landing, ctx.group_comm, others)
            hooks = StageHooks(fanned.add, cluster.peer_failed, lambda: cluster.signal_failure(outcome))
            # Set by the fan-out when it stops: the leader's download stops too (its event
            # loop, on a thread of its own, makes no MPI call: no cluster.peer_failed there).
            stop = threading.Event()
            told = here.local
            own, early = _made(
                lambda: make_downloader(lambda b: told(index[(b.file, b.offset)]), stop.is_set), rank, bool(mine)
            )
            pool = _hold_written(ctx, prepared.shape.fetch, mine, unit)
            done = lead(driver, transfers, feed, own, mine, since, rank, stop, hooks, early, pool)
            digests.update(done.digests or {})
        elif mine and lanes:  # a lane whose chain has nothing to send (what it fetches no other node lacks)
            make_downloader(lambda block: None, cluster.peer_failed).run(mine)
            done = Streamed(since())
        elif mine:
            done = notify_while_downloading(
                ctx.group_comm, index, lambda notice: make_downloader(notice, cluster.peer_failed), mine, since
            )
    _conclude_stream(ctx, t0, outcome, done, made, fanned, progress, prepared, feed)
    return FannedOut((), digests)


def _transfer_progress(ctx: RunContext, prepared: Prepared, label: str = "transfer") -> Progress:
    """A fan-out's progress (streamed or not): the bytes its rail's chain landed on this rank's
    node, of its rail's payload (what it carries, which is what it counts), and the listing's
    files complete there: every file ``[list]`` counted, those it does not carry (present, empty,
    another rail's) complete from the start."""
    schedule = prepared.schedule
    progress = Progress(label, schedule.payload, ctx.show_progress)
    listed = len(prepared.listed.listing.files)
    progress.expect_files(listed, listed - schedule.files)
    return progress


def _landing_here(place: Placement, rank: int) -> list[int]:
    """The ranks whose landed blocks this rank's chain sends: the node's downloaders (the
    leader's chain), or with several rails the lane itself (each lane's chain carries only
    what it downloads)."""
    if place.rails > 1:
        return [rank] if rank in place.topo.downloaders else []
    return place.downloaders_here()


def _rate(cfg: Config, plan: Plan) -> float | None:
    """This rank's share of ``--max-bandwidth`` (bytes per second), over the ranks that download at all."""
    from azcp_cluster.core.throttle import share

    if cfg.max_bandwidth is None:
        return None
    return share(cfg.max_bandwidth, sum(1 for load in plan.loads() if load))


def _notifying(place: Placement, rank: int, of_rank: Mapping[int, object]) -> list[int]:
    """The node's downloaders a streaming leader waits for, by their rank in the node's
    communicator (the leader is its rank 0, the others follow in world-rank order: see
    setup). Exactly those with blocks send notices and an END: one with nothing to fetch
    is not waited for."""
    members = [r for r in place.topo.members(place.group) if r != rank]
    return [1 + members.index(r) for r in place.downloaders_here() if r != rank and of_rank.get(r)]


def _made(make: Callable[[], Fetcher], rank: int, mine: bool = True) -> tuple[Fetcher | None, AzcpError | None]:
    """A leader's own downloader (none if it has no blocks: not ``mine``), or the error of making
    it: the fan-out still runs to its first agreement then, so nobody is left waiting."""
    if not mine:
        return None, None
    try:
        return make(), None
    except Exception as exc:
        return None, as_azcp_error(exc, rank)


def _hold_written(ctx: RunContext, fetch: Config, mine: list[Block], unit: int) -> WritePool | None:
    """A streaming leader's download buffers, told to keep what it writes for the fan-out to send
    from memory (``mine``: its blocks, ``unit``: its transfers' size); None if it downloads none.

    What this rank downloads in its own process lands in the pool's buffers: the pool keeps
    what the requests in flight and its spares leave, if that holds a whole transfer (worker
    processes' buffers are theirs: those blocks are read back from the disk)."""
    from azcp_cluster.core.blocks import holdable, requests_for

    pool = ctx.io.pool if mine else None
    if pool is not None:
        in_flight = min(fetch.concurrency, len(requests_for(mine, fetch.block_size)))
        pool.hold_written(holdable(pool.count, in_flight, -(-unit // pool.size)))
    return pool


def _conclude_stream(
    ctx: RunContext,
    t0: float,
    outcome: StageOutcome[RankFanout],
    done: Streamed,
    made: list[Fetcher],
    fanned: FanOutTally,
    progress: Progress,
    prepared: Prepared,
    feed: LandingFeed | None,
) -> None:
    """The streaming stage's end on this rank: its figures, what it holds released, the agreement."""
    cluster = ctx.cluster
    driver = prepared.driver
    # A rank stopped early downloaded until now (its own stop came with the stage's).
    downloaded = done.downloaded if outcome.error is None or not made else cluster.clock() - t0
    download = download_figures(made[0].stats) if made else None
    fanout = done.fanout
    refused = (fanout.direct_refused if fanout is not None else None) or (download.refused if download else None)
    memory = fanout.memory_bytes if fanout is not None else 0
    outcome.stats = RankFanout(
        fanned.bytes, refused or None, memory=memory, downloaded=downloaded, download=download, lane=prepared.lane
    )
    progress.close()
    if driver is not None and outcome.error is None:
        # Only after a normal end: leaving early, writes may still be queued on the shared
        # disk writers, which look their slots up.
        driver.release()
    if outcome.error is not None:
        cluster.signal_failure(outcome)  # before waiting for the node's downloaders: they stop on it
    if feed is not None:
        feed.finish()
    ctx.io.end_download()
    ctx.io.end_fanout()
    ctx.explain_space(outcome, prepared.needed)

    def record(result: StageResult[RankFanout]) -> None:
        ranks = tuple(result.each(RankFanout()))
        slowest = max(rank.downloaded for rank in ranks)  # the download: to the last byte landed
        ctx.record(figures.Downloaded(slowest, tuple(rank.download or RankDownload() for rank in ranks)))
        payload = prepared.schedule.total
        ctx.record(figures.FannedOut(result.seconds, payload, ranks, result.failed, streamed=True))
        ctx.warn_direct([rank.refused for rank in ranks])

    if made and done.downloaded:  # this rank's download inside the transfer: to its last byte landed
        cluster.note("download", t0, t0 + done.downloaded)
    cluster.conclude(t0, outcome, record, stage="transfer")


class FanOutTally:
    """A leader's fan-out bytes as its transfers complete (on to the progress bar too): a stage that
    fails reports the bytes it did broadcast."""

    def __init__(self, progress: Callable[[int, int], None]) -> None:
        self.bytes = 0
        self._progress = progress

    def add(self, nbytes: int, files: int) -> None:
        """A transfer done here: its bytes, and the files it completed."""
        self.bytes += nbytes
        self._progress(nbytes, files)


def fan_out(ctx: RunContext, place: Placement, prepared: Prepared) -> FannedOut:
    """Fan every byte out to every leader that receives it (temporary names only; see finish).

    Reports the local SOURCE's files that changed while they were read (agreed by all).
    """
    schedule, driver = prepared.schedule, prepared.driver
    if not schedule.anywhere:  # (every rank alike: a lane whose rail has none still joins the agreement)
        return FannedOut((), {})
    cluster = ctx.cluster
    t0 = cluster.clock()
    progress = _transfer_progress(ctx, prepared, "bcast")
    outcome: StageOutcome[RankFanout] = StageOutcome()
    digests: dict[int, str] = {}
    fanned = FanOutTally(progress.add)
    mine = RankFanout()
    with cluster.stage(outcome):
        if driver is not None:  # leaders only; the others wait at the agreement
            stats = driver.run(schedule.transfers, StageHooks(on_bytes=fanned.add))
            digests.update(driver.digests)
            changed = tuple(sorted(driver.changed))
            mine = RankFanout(refused=stats.direct_refused or None, changed=changed, source_bytes=stats.source_bytes)
    ctx.io.end_fanout()  # after its queued writes
    outcome.stats = dataclasses.replace(mine, fanned=fanned.bytes, lane=prepared.lane)
    progress.close()
    if driver is not None and outcome.error is None:  # (see stream)
        driver.release()
    ctx.explain_space(outcome, prepared.needed)

    def record(result: StageResult[RankFanout]) -> None:
        ranks = tuple(result.each(RankFanout()))
        ctx.record(figures.FannedOut(result.seconds, schedule.total, ranks, result.failed, local=ctx.local))
        if not result.failed:
            ctx.warn_direct([rank.refused for rank in ranks])

    result = cluster.conclude(t0, outcome, record, stage="bcast")
    return FannedOut(tuple(sorted({i for st in result.each(RankFanout()) for i in st.changed})), digests)
