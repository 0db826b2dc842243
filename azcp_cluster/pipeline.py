"""The engine: the stages in order, each ending in an agreement of all ranks.

setup -> topology -> list -> diff -> plan -> download -> bcast (+ finalize) -> report.
Each stage's rank-local work is thin glue around the pure core (naming, plan, schedule)
and one I/O module; this file owns only the order and the bookkeeping.
"""

from __future__ import annotations

import dataclasses
import os
import random
import resource
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from azcp_cluster import manifest
from azcp_cluster.broadcast import Broadcaster
from azcp_cluster.cluster import (
    Cluster,
    StageOutcome,
    StageResult,
    as_azcp_error,
    error_from_payload,
    error_payload,
)
from azcp_cluster.config import Config, format_bytes, json_inside_dest
from azcp_cluster.destlock import DestLock, lock_backoff
from azcp_cluster.desttree import DestTree
from azcp_cluster.digests import verdict
from azcp_cluster.errors import (
    AzcpError,
    LocalFSError,
    LockError,
    ReportPathError,
    SourceError,
    TopologyError,
    UsageError,
    VerifyError,
)
from azcp_cluster.localfs import check_space, ensure_dest, expand_dest, free_bytes
from azcp_cluster.localsource import check_overlap, list_local, restat, source_file
from azcp_cluster.model import Listing, decode_listing, encode_listing
from azcp_cluster.plan import Plan, plan_transfers
from azcp_cluster.progress import Progress, wants_progress
from azcp_cluster.report import Report, StageFigures, report_lines
from azcp_cluster.schedule import DIRECT_MIN, Transfer, files_written, transfer_schedule
from azcp_cluster.source import is_url, parse_blob_url
from azcp_cluster.topology import Topology, choose_readers, group_ranks

if TYPE_CHECKING:
    from azcp_cluster.credentials import Authorizer
    from azcp_cluster.diskwriter import DiskWriter
    from azcp_cluster.download import Downloader, WritePool
    from azcp_cluster.interrupts import Interrupts


def _attach(error: AzcpError, report: Report) -> AzcpError:
    error.report = report  # type: ignore[attr-defined]
    report.exit_code = error.exit_code
    report.error = error.one_line()
    return error


EMPTY_MD5 = "1B2M2Y8AsgTpgAmY7PhCfg=="  # base64 MD5 of no bytes


def available_memory() -> int:
    """Bytes of memory available for new allocations (MemAvailable; all RAM if unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_reader(sees: list[bool], requested: int | None, source: str) -> int:
    """The rank that reads a local SOURCE: ``requested`` (``--source-rank``) or the lowest that sees it."""
    if requested is not None:
        if not 0 <= requested < len(sees):
            raise UsageError(f"--source-rank {requested} is not a rank of this job (0..{len(sees) - 1})")
        if not sees[requested]:
            raise TopologyError(f"--source-rank {requested} cannot see SOURCE", path=source)
        return requested
    for rank, seen in enumerate(sees):
        if seen:
            return rank
    raise UsageError(f"SOURCE {source!r} is neither a blob URL nor a path that exists on any rank")


def run(
    cfg: Config,
    comm: Any,
    *,
    env: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    out: TextIO | None = None,
    host: str | None = None,
    credential: Any = None,
    interrupts: Interrupts | None = None,
) -> Report:
    """Run every stage on this rank (collectively with the others in ``comm``).

    Returns the report on every rank; raises the same typed :class:`AzcpError` on every
    rank if any rank fails (the error carries the partial report as ``.report``).
    ``credential`` (a TokenCredential or a SAS) comes before the environment's.
    """
    env = os.environ if env is None else env
    out = sys.stdout if out is None else out
    cluster = Cluster(comm, clock, interrupts)  # interrupts: the CLI's SIGINT/SIGTERM recorder
    report = Report(ranks=cluster.size, dry_run=cfg.dry_run)
    started = clock()
    state = _Run(cfg, cluster, report, env, wall, out, host or socket.gethostname(), started, credential)
    try:
        state.execute()
    except AzcpError as exc:
        report.stages["total"].seconds = clock() - started
        raise _attach(exc, report) from None
    finally:
        state.close()
        cluster.close()
    return report


class _Run:
    """One run's state, stage by stage."""

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        report: Report,
        env: Mapping[str, str],
        wall: Callable[[], float],
        out: TextIO,
        host: str,
        started: float,
        credential: Any = None,
    ) -> None:
        self.started = started
        self.credential = credential  # the Python API's credential=, else None
        self.cfg = cfg
        self.cluster = cluster
        self.report = report
        self.env = env
        self.wall = wall
        self.out = out
        self.host = host
        self.rank = cluster.rank
        # Absolute, but not normalised: "link/../x" is where the kernel says, not "x".
        self.dest = os.path.join(os.getcwd(), expand_dest(cfg.dest, self.rank, host))
        # Symlinks and "..": two spellings of one directory are still one directory.
        self.dest_identity = os.path.realpath(self.dest)
        self.show_progress = wants_progress(cfg.progress, self.rank)
        self._warned_direct = False
        # A SOURCE without a scheme is a path: one rank reads it, the others receive it.
        self.local = not is_url(cfg.source)
        self.source_root = os.path.abspath(cfg.source) if self.local else ""
        self.single_file = False  # a local SOURCE that is one file, not a tree
        # Filled in by setup: who leads, who downloads, who reads (see topology.py).
        self.topo = Topology(group_of=(0,), leaders=(0,), downloaders=(0,), hosts=1)
        self.leader = True
        self.reader = 0  # lists the source (and reads it, when it is local)
        self.readers: list[int] = []  # a local SOURCE: every rank that reads it (--source-readers)
        self.node_comm: Any = None  # the leaders' communicator, for the broadcast
        self.group_comm: Any = None  # this node's ranks, its leader as rank 0
        # Filled in by the stages, in order: list, diff, bcast.
        self._list_seconds = 0.0
        self.have: np.ndarray = np.zeros(0, dtype=bool)  # per file: this rank's group already has it
        self.sizes: list[int] = []  # per file: its size (from the listing)
        self.receives: set[int] = set()  # files the schedule brings to this rank's node
        self.streamed_md5: dict[int, str] = {}  # --verify: file index -> MD5 hashed in flight
        self.verified_md5: dict[int, str] = {}  # --verify: file index -> the MD5 every copy has
        self.bytes_to_write = 0  # bytes of the files this rank's node writes (for a full-disk message)
        self.write_pool: WritePool | None = None  # the download's buffers and writers (allocate stage)
        self.disk: DiskWriter | None = None  # streaming leaders that download: writers shared with the fan-out
        # DEST opened by its real path (leaders, and downloaders once it exists): every file
        # below it is reached through this handle, never through a link (desttree.py).
        self.tree: DestTree | None = None
        self.dest_lock: DestLock | None = None  # leaders: held from setup to the end of the run

    def close(self) -> None:
        """Stop the download writer threads; release DEST; free the leaders' communicator."""
        if self.write_pool is not None:
            self.write_pool.close()
            self.write_pool = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.dest_lock is not None:
            self.dest_lock.close()
            self.dest_lock = None
        if self.tree is not None:
            self.tree.close()
            self.tree = None
        if self.node_comm is not None:
            self.node_comm.Free()
            self.node_comm = None
        if self.group_comm is not None:
            self.group_comm.Free()
            self.group_comm = None

    def execute(self) -> None:
        auth = self.setup()
        listing = self.list_stage(auth)
        transfer, holders = self.diff(listing)
        topo = self.topo
        owners = list(self.readers) if self.local else list(topo.downloaders)
        plan = plan_transfers(
            [f.size for f in listing.files], holders, topo.size, self.cfg.shard_size, owners=owners, copies=topo.groups
        )
        self.report.plan_loads = plan.loads()
        self.report.plan_spread = plan.spread(owners)
        self.report.broadcast_shards = len(plan.shards)
        if self.cfg.dry_run:
            self.print_plan(listing, transfer, plan)
            self.print_report()
            return
        # The broadcast runs between leaders: a shard goes out from its owner's leader.
        schedule = self.schedule_for(plan)
        broadcaster = self.allocate(listing, transfer, schedule, plan)
        if not self.local and self.cfg.overlap and any(plan.loads()):
            assert auth is not None
            changed = self.stream(listing, plan, schedule, broadcaster, auth)
        else:
            if not self.local:
                assert auth is not None
                self.download(listing, plan, auth)
            changed = self.bcast(schedule, broadcaster)
        del broadcaster  # its slots: a second round maps its own
        if changed:
            listing = self.read_again(listing, changed)
        self.sync(listing, transfer)
        if self.cfg.verify:
            self.verify(listing, transfer)  # before the rename: a mismatch leaves no final name
        self.finish(listing, transfer)
        self.record(listing, transfer)
        self.print_report()

    # -- stages ---------------------------------------------------------------------------

    def setup(self) -> Authorizer | None:
        """Check the arguments, find the reader, group the ranks by node, create DEST."""
        cluster = self.cluster
        cfg = self.cfg
        outcome = StageOutcome()
        t0 = cluster.clock()
        auth: Authorizer | None = None
        sees = False
        with cluster.stage(outcome):
            cfg.validate()
            if self.local:
                # With --source-rank, only that rank looks: a shared filesystem sees one client.
                if cfg.source_rank in (None, self.rank):
                    sees = os.path.exists(self.source_root)
                if not cfg.dry_run:
                    cfg.check_memory(available_memory(), 0)
            else:
                if cfg.source_readers > 1:
                    raise UsageError("--source-readers is for a local SOURCE; a blob URL is read by the downloaders")
                # Imported here: a local SOURCE never pays for the Azure and HTTP libraries.
                from azcp_cluster.credentials import Authorizer, resolve_credential
                from azcp_cluster.download import pool_bytes

                source = parse_blob_url(cfg.source)
                if not cfg.dry_run:
                    cfg.check_memory(available_memory(), pool_bytes(cfg.concurrency))
                auth = Authorizer(source, resolve_credential(source, self.env, cfg.auth, self.credential), self.wall)
            outcome.stats = {"place": (self.host, self.dest_identity), "sees": sees}
        result = cluster.conclude(t0, outcome)
        places = [st["place"] for st in result.stats]
        outcome = StageOutcome()
        with cluster.stage(outcome):
            if self.local:
                sees_all = [st["sees"] for st in result.stats]
                if cfg.source_readers > 1:
                    self.readers = choose_readers(sees_all, places, cfg.source_readers)
                    self.reader = self.readers[0]
                else:
                    self.reader = choose_reader(sees_all, cfg.source_rank, cfg.source)
                    self.readers = [self.reader]
            self.topo = group_ranks(
                places,
                preferred_leader=self.reader if self.local else None,
                download_ranks=cfg.download_ranks,
                readers=self.readers,
            )
            self.leader = self.topo.is_leader(self.rank)
            if self.local:  # on every rank: each knows only its own DEST
                check_overlap(os.path.realpath(self.source_root), self.dest_identity)
            if cfg.json_path and json_inside_dest(os.path.realpath(cfg.json_path), self.dest_identity):
                raise ReportPathError(f"--json {cfg.json_path} lies inside DEST; write the report outside it")
            if self.leader:
                ensure_dest(self.dest, create=not cfg.dry_run)
                self.tree = DestTree(self.dest, create=not cfg.dry_run)
        cluster.conclude(t0, outcome)
        if not cfg.dry_run:
            self.lock_dest(t0)
        topo = self.topo
        # Collective on every rank; leaders get one communicator, ordered by group.
        self.node_comm = cluster.comm.Split(0 if self.leader else 1, topo.group_of[self.rank])
        # Each node's own ranks, its leader first: the leader hands its downloaders the
        # identities of the temporary files it made (they write into no other file).
        self.group_comm = cluster.comm.Split(topo.group_of[self.rank], 0 if self.leader else self.rank + 1)
        report = self.report
        report.nodes = topo.hosts
        report.writers = topo.groups
        report.download_ranks = 0 if self.local else len(topo.downloaders)
        report.source_rank = self.reader if self.local else None
        report.source_readers = list(self.readers)
        return auth

    def lock_dest(self, t0: float) -> None:
        """Every leader takes its DEST's lock, all or none (see destlock.py): try, agree, release, back off.

        Nobody waits while holding a lock, so jobs that share nodes in any order cannot
        deadlock. ``--lock fail`` ends at the first refusal, ``--lock-timeout`` after that
        long (the slowest rank's clock, so every rank decides alike); exit 9.
        """
        cluster = self.cluster
        cfg = self.cfg
        # The pid alone is not unique (containers have their own pid namespaces): a random
        # token tells this run's ranks from another run's.
        me = f"{self.host} pid {os.getpid()}, run {random.getrandbits(32):08x}"
        rng = random.Random()
        attempt = 0
        waited = False
        while True:
            outcome = StageOutcome()
            with cluster.stage(outcome):
                held_by = None
                if self.leader:
                    assert self.tree is not None
                    if self.dest_lock is None:
                        self.dest_lock = DestLock(self.tree, me)
                    held_by = self.dest_lock.try_acquire()
                outcome.stats = {"held_by": held_by, "me": me, "dest": self.dest}
            result = cluster.conclude(t0, outcome)
            refused = [(rank, st) for rank, st in enumerate(result.stats) if st["held_by"] is not None]
            if not refused:
                return
            if self.dest_lock is not None:
                self.dest_lock.release()
            rank, st = refused[0]
            ours = {other["me"]: r for r, other in enumerate(result.stats)}
            if st["held_by"] in ours:
                raise TopologyError(
                    f"DEST is the same directory for rank {ours[st['held_by']]} on another host (a shared "
                    "filesystem): give each node its own DEST, e.g. with {host}",
                    path=st["dest"],
                    rank=rank,
                )
            holder = f"in use by another run (host {st['held_by']})"
            if cfg.lock == "fail":
                raise LockError(f"DEST is {holder}; --lock fail", path=st["dest"], rank=rank)
            if cfg.lock_timeout is not None and result.seconds >= cfg.lock_timeout:
                raise LockError(
                    f"DEST is still {holder} after --lock-timeout {cfg.lock_timeout:g} s", path=st["dest"], rank=rank
                )
            if not waited and self.rank == 0:
                print(
                    f"azcp-cluster: notice: rank {rank}: DEST {st['dest']} is {holder}; waiting for it to end "
                    "(--lock fail exits instead)",
                    file=sys.stderr,
                    flush=True,
                )
            waited = True
            time.sleep(lock_backoff(attempt, rng))
            attempt += 1

    def list_stage(self, auth: Authorizer | None) -> Listing:
        """The lister (rank 0, or the reader of a local SOURCE) lists; everyone gets the list."""
        cluster = self.cluster
        t0 = cluster.clock()
        payload: bytes | None = None
        outcome = StageOutcome()
        if self.rank == self.reader:
            with cluster.stage(outcome), cluster.abandonable():  # a signal stops the listing at once
                if self.local:
                    listed = list_local(self.source_root, self.cfg)
                else:
                    from azcp_cluster.listing import list_source

                    assert auth is not None
                    listed = list_source(parse_blob_url(self.cfg.source), auth, self.cfg)
                payload = encode_listing(listed)
        single = self.local and self.rank == self.reader and os.path.isfile(self.source_root)
        message = (payload, error_payload(outcome.error) if outcome.error else None, single)
        payload, failure, single = cluster.bcast_object(message, root=self.reader)
        if failure is not None:
            raise error_from_payload(failure)
        self.single_file = bool(single)
        listing = decode_listing(payload)
        self._list_seconds = cluster.clock() - t0
        self.report.files = len(listing.files)
        self.report.bytes = listing.total_bytes
        self.report.markers_skipped = listing.markers_skipped
        self.report.filtered_out = listing.filtered_out
        self.report.stages["list"] = StageFigures(self._list_seconds, 0)
        if not listing.files and self.rank == 0:
            # Not an error (an empty prefix is a valid, finished copy), but rarely intended.
            what = "filters left no file" if listing.filtered_out else "SOURCE matched no files"
            print(f"azcp-cluster: warning: {what}; nothing to copy", file=sys.stderr, flush=True)
        return listing

    def diff(self, listing: Listing) -> tuple[list[int], list[list[int]]]:
        """Which files to transfer, and for each file the leaders whose copy already has it."""
        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        files = listing.files
        with cluster.stage(outcome):
            present = b""
            if self.leader:  # one check per copy: the other ranks of a node share the leader's
                with cluster.abandonable():  # hashing (--compare md5): a signal stops it at once
                    bits = np.array(manifest.present(self.dest_tree(), files, self.cfg.compare), dtype=bool)
                present = np.packbits(bits).tobytes()
            outcome.stats = {"present": present, "list_seconds": self._list_seconds}
        result = cluster.conclude(t0, outcome)
        leaders = self.topo.leaders
        matrix = np.stack(
            [
                np.unpackbits(np.frombuffer(result.stats[leader]["present"], dtype=np.uint8), count=len(files)).astype(
                    bool
                )
                for leader in leaders
            ]
        )  # groups x files
        self.have = matrix[self.topo.group_of[self.rank]]
        self.sizes = [f.size for f in files]
        everywhere = matrix.all(axis=0)
        transfer = [int(i) for i in np.flatnonzero(~everywhere)]
        holders = [[leaders[g] for g in np.flatnonzero(matrix[:, i])] for i in range(len(files))]
        report = self.report
        report.stages["list"].seconds = max(s["list_seconds"] for s in result.stats)
        report.skipped_files = len(files) - len(transfer)
        report.skipped_bytes = sum(files[i].size for i in np.flatnonzero(everywhere))
        report.transfer_files = len(transfer)
        report.peer_files = sum(1 for i in transfer if holders[i])
        report.azure_files = report.transfer_files - report.peer_files
        report.stages["diff"] = StageFigures(result.seconds, 0)
        return transfer, holders

    def dest_tree(self) -> DestTree:
        """This rank's handle on DEST (opened here by a downloader that is not its node's leader)."""
        if self.tree is None:
            self.tree = DestTree(self.dest, create=not self.cfg.dry_run)
        return self.tree

    def allocate(
        self, listing: Listing, transfer: list[int], schedule: list[Transfer], plan: Plan
    ) -> Broadcaster | None:
        """Create the temporary files, the download buffers and the broadcast slots, in an
        agreement of their own.

        Before any download: a node's other ranks write into the temporary files its leader
        creates here. A rank that cannot get its memory fails here, before anything is
        downloaded, and never stays out of the Ibcasts the others have entered.
        """
        if not transfer:
            return None  # nothing to write: a rerun stays cheap
        cluster = self.cluster
        outcome = StageOutcome()
        broadcaster: Broadcaster | None = None
        with cluster.stage(outcome):
            mine = plan.owned_by(self.rank)
            if not self.local and mine:
                from azcp_cluster.download import WritePool, blocks_for, pool_buffers_for

                # Mapped now, with its writer threads started: the download stage then
                # measures the transfer, not page faults and thread start-up. No more
                # buffers than this rank's requests can fill at once.
                blocks = len(blocks_for(mine, self.cfg.block_size))
                if self.leader and self.cfg.overlap:
                    # Streaming: this rank's download and its fan-out write at once; one
                    # set of writer threads for both (diskwriter.py).
                    from azcp_cluster.diskwriter import DiskWriter
                    from azcp_cluster.download import WRITER_THREADS

                    self.disk = DiskWriter(WRITER_THREADS + self.cfg.bcast_writers)
                self.write_pool = WritePool(
                    self.cfg,
                    populate=True,
                    buffers=pool_buffers_for(self.cfg.concurrency, blocks),
                    writer=self.disk,
                )
            if self.leader:
                missing = self.missing_here(transfer)
                # Checked before anything is written, where the sizes are known.
                self.bytes_to_write = sum(listing.files[i].size for i in missing)
                later = self.made_on_arrival(plan, missing)
                self.prepare_files(listing, missing, later)
                broadcaster = self.broadcaster(listing, schedule, later)
        self.explain_space(outcome)  # the files' blocks are reserved here: a full disk shows here first
        cluster.conclude(cluster.clock(), outcome)
        if not self.local and any(not self.topo.is_leader(r) for r in self.topo.downloaders):
            # Some node has downloaders besides its leader: they get the files' identities.
            made = self.group_comm.bcast(self.tree.made if self.leader and self.tree is not None else None, root=0)
            if mine and not self.leader:
                self.dest_tree().adopt(made or {})  # DEST exists now: its leader made it
        return broadcaster

    def prepare_files(self, listing: Listing, indices: list[int], later: Sequence[int] = ()) -> None:
        """Leaders: check the space, then make the temporary files of ``indices`` anew at full size
        (those in ``later`` are made by the broadcast's writers, see DestTree.prepare_all)."""
        tree = self.dest_tree()
        entries = [(listing.files[i].path, listing.files[i].size) for i in indices]
        check_space(self.dest, tree.space_needed(entries))
        tree.prepare_all(entries, later=[listing.files[i].path for i in later])

    def made_on_arrival(self, plan: Plan, missing: list[int]) -> list[int]:
        """The small files this node only receives (no rank of the node downloads into them):
        their writer creates them when their bytes arrive, one open each instead of two."""
        group = self.topo.group_of[self.rank]
        # A local SOURCE's plan names its readers as owners: they read it, nobody downloads.
        downloaded = (
            set()
            if self.local
            else {s.file for s in plan.shards if not s.peer and self.topo.group_of[s.owner] == group}
        )
        return [i for i in missing if 0 < self.sizes[i] < DIRECT_MIN and i not in downloaded]

    def broadcaster(self, listing: Listing, schedule: list[Transfer], later: Sequence[int] = ()) -> Broadcaster | None:
        """Leaders: the broadcast engine for ``schedule``, its slots mapped now."""
        if not schedule:
            return None
        return Broadcaster(
            self.node_comm,
            listing.files,
            self.dest_tree(),
            max(t.length for t in schedule),  # no slot larger than the largest transfer
            pipeline=min(self.cfg.bcast_pipeline, len(schedule)),
            writers=self.cfg.bcast_writers,
            direct=self.cfg.bcast_direct,
            have=self.have.tolist(),
            verify=bool(self.cfg.verify),
            source_of=self.read_from_source(listing) if self.rank in self.readers and self.local else None,
            stop_requested=self.cluster.interrupted,
            made_on_arrival=set(later),
            disk=self.disk,
        )

    def read_from_source(self, listing: Listing) -> Callable[[int], str | None]:
        """For the reader of a local SOURCE: where each file it lacks is read from."""
        have = self.have

        def where(index: int) -> str | None:
            if have[index]:
                return None  # sent from the reader's own complete copy
            return source_file(self.source_root, listing.files[index].name, self.single_file)

        return where

    def download(self, listing: Listing, plan: Plan, auth: Authorizer) -> None:
        """Every downloader fetches its shards into its node's temporary files."""
        from azcp_cluster.download import blocks_for

        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        mine = plan.owned_by(self.rank)
        progress = Progress("download", sum(s.length for s in mine), self.show_progress)
        with cluster.stage(outcome):
            stats = None
            if mine:
                downloader = self.downloader(listing, plan, auth, progress.add)
                stats = downloader.run(blocks_for(mine, self.cfg.block_size))
            if stats is not None:
                outcome.stats = {
                    "bytes": stats.bytes,
                    "retries": stats.retries,
                    "causes": dict(stats.retry_causes),
                    "refused": stats.direct_refused,
                }
        progress.close()
        if self.write_pool is not None:  # its memory is not needed by the broadcast
            self.write_pool.close()
            self.write_pool = None
        self.explain_space(outcome)
        if outcome.error is not None:
            cluster.signal_failure(outcome)
        result = cluster.conclude(t0, outcome)
        self.record_download(result)
        self.report.stages["download"] = StageFigures(result.seconds, self.report.downloaded_bytes)

    def downloader(self, listing: Listing, plan: Plan, auth: Authorizer, on_bytes: Callable[[int], None]) -> Downloader:
        """This rank's downloader for its share of ``plan`` (paced by its share of --max-bandwidth)."""
        from azcp_cluster.download import Downloader
        from azcp_cluster.throttle import Pacer, share

        pacer = None
        if self.cfg.max_bandwidth is not None:
            busy = sum(1 for load in plan.loads() if load)  # ranks that download at all
            pacer = Pacer(share(self.cfg.max_bandwidth, busy), burst=self.cfg.block_size, clock=self.cluster.clock)
        return Downloader(
            listing.files,
            self.dest_tree(),
            auth,
            self.cfg,
            peer_failed=self.cluster.peer_failed,
            on_bytes=on_bytes,
            pacer=pacer,
            pool=self.write_pool,
        )

    def record_download(self, result: StageResult) -> None:
        """The download's figures in the report: bytes, retries and their causes."""
        causes: Counter[str] = Counter()
        for stats_of_rank in result.stats:
            causes.update(stats_of_rank.get("causes", {}))
        self.report.downloaded_bytes = result.total("bytes")
        self.report.retries = result.total("retries")
        self.report.retries_by_rank = [int(st.get("retries", 0)) for st in result.stats]
        self.report.retry_causes = dict(causes)
        self.warn_direct(result.stats)

    def stream(
        self, listing: Listing, plan: Plan, schedule: list[Transfer], broadcaster: Broadcaster | None, auth: Authorizer
    ) -> list[int]:
        """Download and fan out at once: a transfer goes out as soon as its bytes are on its root's node.

        Roles and the protocol are in streaming.py and docs/architecture.md ("Streaming").
        One failure signal for the whole stage: a rank that fails signals the others (their
        downloads stop, their fan-outs stop waiting for bytes) and the fan-out's agreements
        stop every leader at the same transfer. Reported as both stages: ``download`` until
        the last byte landed, ``bcast`` the whole stage (they overlap).
        """
        from azcp_cluster.download import Block, blocks_for
        from azcp_cluster.streaming import LandingFeed, Streamed, lead, node_blocks, notify_while_downloading

        cluster = self.cluster
        topo = self.topo
        t0 = cluster.clock()
        group = topo.group_of[self.rank]
        downloaders = [r for r in topo.downloaders if topo.group_of[r] == group]
        blocks, landing = node_blocks(schedule, plan, group, downloaders, self.cfg.block_size, blocks_for)
        mine = [Block(*blocks.blocks[i]) for i in blocks.of_rank.get(self.rank, ())]
        index = {(f, o): i for i, (f, o, _) in enumerate(blocks.blocks)}
        total = sum(e.length for t in schedule for e in t.extents)  # payload: not the alignment padding
        progress = Progress("transfer", total, self.show_progress)
        progress.expect_download(sum(s.length for s in plan.owned_by(self.rank)))
        progress.expect_files(len({e.file for t in schedule for e in t.extents}))
        outcome = StageOutcome()
        feed: LandingFeed | None = None

        def since() -> float:
            return cluster.clock() - t0

        with cluster.stage(outcome):
            done = Streamed(0.0)
            if self.leader:
                # The node's communicator: the leader is its rank 0, the others follow in
                # world-rank order (see setup). Exactly the downloaders that have blocks send
                # notices and an END: one with nothing to fetch is not waited for.
                members = [r for r in topo.members(group) if r != self.rank]
                others = [1 + members.index(r) for r in downloaders if r != self.rank and blocks.of_rank.get(r)]
                feed = LandingFeed(landing, self.group_comm, others)
                assert broadcaster is not None
                broadcaster.on_bytes = progress.add
                broadcaster.announce = lambda: cluster.signal_failure(outcome)
                broadcaster.peer_failed = cluster.peer_failed
                downloader = None
                early: AzcpError | None = None
                try:
                    downloader = self.downloader(listing, plan, auth, progress.add_download) if mine else None
                except Exception as exc:  # the fan-out still runs to its first agreement: nobody is left waiting
                    early = as_azcp_error(exc, self.rank)
                done = lead(broadcaster, schedule, feed, downloader, mine, index, since, self.rank, early)
                self.streamed_md5.update(done.digests or {})
            elif mine:
                done = notify_while_downloading(
                    self.group_comm,
                    index,
                    lambda: self.downloader(listing, plan, auth, progress.add_download),
                    mine,
                    since,
                )
            stats: dict[str, Any] = {"downloaded": done.downloaded}
            if done.download is not None:
                dstats = done.download
                stats.update(bytes=dstats.bytes, retries=dstats.retries, causes=dict(dstats.retry_causes))
                stats["refused"] = dstats.direct_refused
            if done.fanout is not None and done.fanout.direct_refused:
                stats["refused"] = done.fanout.direct_refused
            outcome.stats = stats
        progress.close()
        if outcome.error is not None:
            cluster.signal_failure(outcome)  # before waiting for the node's downloaders: they stop on it
        if feed is not None:
            feed.finish()
        if self.write_pool is not None:
            self.write_pool.close()
            self.write_pool = None
        self.explain_space(outcome)
        result = cluster.conclude(t0, outcome)
        self.record_download(result)
        self.report.stages["download"] = StageFigures(
            max(float(st.get("downloaded", 0.0)) for st in result.stats), self.report.downloaded_bytes
        )
        self.report.overlap = True
        self.report.broadcast_bytes += total
        figures = self.report.stages["bcast"]
        figures.seconds += result.seconds
        figures.bytes += total
        return []

    def bcast(self, schedule: list[Transfer], broadcaster: Broadcaster | None) -> list[int]:
        """Fan every byte out to every leader (temporary names only; see finish).

        Returns the local SOURCE's files that changed while they were read (agreed by all).
        """
        if not schedule:
            return []
        cluster = self.cluster
        t0 = cluster.clock()
        total = sum(e.length for t in schedule for e in t.extents)  # payload: not the alignment padding
        progress = Progress("bcast", total, self.show_progress)
        progress.expect_files(len({e.file for t in schedule for e in t.extents}))
        outcome = StageOutcome()
        with cluster.stage(outcome):
            if broadcaster is not None:  # leaders only; the others wait at the agreement
                broadcaster.on_bytes = progress.add
                stats = broadcaster.run(schedule)
                self.streamed_md5.update(broadcaster.digests)
                outcome.stats = {
                    "refused": stats.direct_refused,
                    "changed": sorted(broadcaster.changed),
                    "source_bytes": stats.source_bytes,
                }
        progress.close()
        self.explain_space(outcome)
        result = cluster.conclude(t0, outcome)
        self.report.broadcast_bytes += total
        self.warn_direct(result.stats)
        if self.local:
            read = [int(st.get("source_bytes", 0)) for st in result.stats]
            before = self.report.source_bytes_by_rank or [0] * len(read)
            self.report.source_bytes_by_rank = [a + b for a, b in zip(before, read, strict=True)]
        figures = self.report.stages["bcast"]  # a second round (read_again) adds to the first
        figures.seconds += result.seconds
        figures.bytes += total
        return sorted({i for st in result.stats for i in st.get("changed", ())})

    def read_again(self, listing: Listing, changed: list[int]) -> Listing:
        """Send the local SOURCE's files that changed while they were read once more, as they are now.

        The reader looks at them again; every node makes their temporary files anew and
        receives them again (a torn copy never reaches a final name: the rename comes after).
        A file that changes again while it is read ends the run (exit 5), naming it.
        """
        cluster = self.cluster
        outcome = StageOutcome()
        fresh: list[Any] = []
        if self.rank == self.reader:
            with cluster.stage(outcome):
                fresh = [restat(self.source_root, listing.files[i], self.single_file) for i in changed]
        message = (fresh, error_payload(outcome.error) if outcome.error else None)
        fresh, failure = cluster.bcast_object(message, root=self.reader)
        if failure is not None:
            raise error_from_payload(failure)
        files = list(listing.files)
        for index, entry in zip(changed, fresh, strict=True):
            files[index] = entry
        listing = dataclasses.replace(listing, files=tuple(files))
        self.report.bytes = listing.total_bytes
        self.have[changed] = False  # a copy some node had is of another version now
        self.sizes = [f.size for f in files]
        topo = self.topo
        lacking = set(changed)
        holders = [[] if i in lacking else list(topo.leaders) for i in range(len(files))]
        plan = plan_transfers(
            [f.size for f in files], holders, topo.size, self.cfg.shard_size, owners=[self.reader], copies=topo.groups
        )
        schedule = self.schedule_for(plan)
        outcome = StageOutcome()
        broadcaster: Broadcaster | None = None
        with cluster.stage(outcome):
            if self.leader:
                self.prepare_files(listing, changed)
                broadcaster = self.broadcaster(listing, schedule)
        self.explain_space(outcome)
        cluster.conclude(cluster.clock(), outcome)
        again = self.bcast(schedule, broadcaster)
        if again:
            raise SourceError(
                "the file changed while it was read, twice (it is being written to); copy it once it is complete",
                path=source_file(self.source_root, files[again[0]].name, self.single_file),
            )
        return listing

    def explain_space(self, outcome: StageOutcome) -> None:
        """Add what this node needed and has free to a full-disk error raised while writing."""
        error = outcome.error
        if isinstance(error, LocalFSError) and getattr(error, "no_space", False):
            try:
                free = f"{free_bytes(self.dest)} bytes free"
            except OSError:
                free = "free space unknown"
            error.message += f" ({self.bytes_to_write} bytes needed on this node, {free})"

    def warn_direct(self, stats: list[dict[str, Any]]) -> None:
        """One line on rank 0 (once per run) when some rank's filesystem refused O_DIRECT."""
        refused = [(rank, st["refused"]) for rank, st in enumerate(stats) if st.get("refused")]
        if not refused or self._warned_direct:
            return
        self._warned_direct = True
        if self.rank == 0:
            ranks = ", ".join(str(r) for r, _ in refused)
            print(
                f"azcp-cluster: warning: the filesystem of DEST refuses O_DIRECT on rank(s) {ranks} "
                f"(e.g. {refused[0][1]}): writing through the page cache there",
                file=sys.stderr,
                flush=True,
            )

    def sync(self, listing: Listing, transfer: list[int]) -> None:
        """fsync every file this node wrote, once every rank has every byte (counted in the bcast stage)."""
        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        with cluster.stage(outcome):
            if self.leader and transfer:
                self.dest_tree().sync_all([listing.files[i].path for i in self.missing_here(transfer)])
        self.explain_space(outcome)
        result = cluster.conclude(t0, outcome)
        self.report.stages["bcast"].seconds += result.seconds

    def finish(self, listing: Listing, transfer: list[int]) -> None:
        """Rename every file this node wrote to its final name, then fsync their directories."""
        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        with cluster.stage(outcome):
            if self.leader and transfer:
                tree = self.dest_tree()
                paths = [listing.files[i].path for i in self.missing_here(transfer)]
                tree.rename_all(paths)  # each directory walked once, 8 directories at a time
                tree.sync_dirs(paths)
            # ru_maxrss is in KiB on Linux: the rank's peak resident memory of the whole run.
            outcome.stats = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        self.explain_space(outcome)
        result = cluster.conclude(t0, outcome)
        self.report.stages["bcast"].seconds += result.seconds
        self.report.peak_rss_bytes = max(int(st.get("rss", 0)) for st in result.stats)

    def verify(self, listing: Listing, transfer: list[int]) -> None:
        """Compare every file's MD5 across ranks and with the blob's Content-MD5 (exit 7 on a mismatch).

        ``--verify disk`` (the default mode): after the fsync, each leader reads every copy
        back from its disk (O_DIRECT, several files at once) and hashes it: a copy that the
        disk, the filesystem or another writer changed after it arrived differs from the
        bytes hashed in flight, which is checked too. ``--verify stream``: only the bytes
        hashed as they passed through the broadcast (files nobody transferred are read back).
        """
        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        files = listing.files
        disk = self.cfg.verify == "disk"
        with cluster.stage(outcome):
            digests: dict[int, str] = {}
            if self.leader:  # one copy per node
                tree = self.dest_tree()
                written = set(self.missing_here(transfer))
                streamed = dict(self.streamed_md5)
                for i in transfer:
                    if files[i].size == 0:
                        streamed[i] = EMPTY_MD5
                # Read back: everything this node holds (disk), or what was not streamed past
                # this rank. A file the schedule did not bring here (a subset) is not here.
                held = [i for i in range(len(files)) if i in written or self.have[i]]
                reread = [i for i in held if disk or i not in streamed]

                def hash_copy(i: int) -> str:
                    rel = files[i].path
                    try:
                        opener = tree.opener(rel, temp=i in written)
                        return manifest.md5_of(opener, direct=disk and self.cfg.bcast_direct)
                    except OSError as exc:
                        where = tree.temp_shown(rel) if i in written else tree.shown(rel)
                        raise VerifyError(f"cannot read the copy back: {exc.strerror or exc}", path=where) from None

                with self.cluster.abandonable():  # local work: a signal stops it at once
                    digests = dict(zip(reread, manifest.hash_files(hash_copy, reread), strict=True))
                for i, digest in streamed.items():
                    if i not in digests:
                        digests[i] = digest  # --verify stream
                    elif digests[i] != digest:
                        raise VerifyError(
                            "the copy on disk differs from the bytes this rank received (changed after they "
                            "arrived: by the disk, the filesystem or another writer)",
                            path=tree.shown(files[i].path),
                        )
            outcome.stats = {"md5": digests}
        result = cluster.conclude(t0, outcome)
        self.verified_md5 = verdict(files, [(rank, result.stats[rank]["md5"]) for rank in self.topo.leaders])
        self.report.verified_files = len(self.verified_md5)
        self.report.stages["verify"] = StageFigures(result.seconds, self.report.bytes)

    def record(self, listing: Listing, transfer: list[int]) -> None:
        """Update every rank's manifest with what is now known to be in DEST.

        Copied files are the listed version. A skipped file is only known to be the listed
        version if its ETag or MD5 was checked; after a size check its entry stays as it was.
        """
        cluster = self.cluster
        outcome = StageOutcome()
        files = listing.files
        # Only what this node has now: a file the schedule did not bring here (a subset of
        # receivers) is not in its DEST.
        written = set(self.missing_here(transfer))
        copied = [i for i in transfer if i in written or self.have[i]]
        indices = range(len(files)) if self.cfg.compare in ("etag", "md5") else copied
        # A file without a Content-MD5 (a local SOURCE, a blob uploaded without one) is
        # recorded with the MD5 --verify found on every copy: --compare md5 can use it next time.
        known = [
            dataclasses.replace(files[i], content_md5=self.verified_md5[i])
            if not files[i].content_md5 and i in self.verified_md5
            else files[i]
            for i in indices
        ]
        with cluster.stage(outcome):
            if self.leader:
                tree = self.dest_tree()
                manifest.save(tree, known, manifest.load(tree))
        cluster.conclude(cluster.clock(), outcome)

    def schedule_for(self, plan: Plan) -> list[Transfer]:
        """The transfers between the leaders for ``plan`` (a shard goes out from its owner's leader),
        and what this rank's node writes of them (:meth:`missing_here`)."""
        topo = self.topo
        schedule = transfer_schedule(plan, self.cfg.bcast_chunk, topo.groups, root_of=topo.group_of)
        self.receives |= files_written(schedule, topo.group_of[self.rank])  # a second round adds to the first
        return schedule

    def missing_here(self, transfer: list[int]) -> list[int]:
        """The transferred files this rank's node does not have yet and the schedule brings it
        (it writes and renames these); empty files are made on every node."""
        sizes = self.sizes
        return [i for i in transfer if not self.have[i] and (sizes[i] == 0 or i in self.receives)]

    # -- output ---------------------------------------------------------------------------

    def print_plan(self, listing: Listing, transfer: list[int], plan: Plan) -> None:
        if self.rank != 0:
            return
        counts = [0] * plan.nranks
        files_of: list[set[int]] = [set() for _ in range(plan.nranks)]
        for shard in plan.shards:
            files_of[shard.owner].add(shard.file)
        for rank in range(plan.nranks):
            counts[rank] = len(files_of[rank])
        loads = plan.loads()
        print(f"[plan] {len(transfer)} files, {len(plan.shards)} shards over {plan.nranks} ranks", file=self.out)
        for rank in range(plan.nranks):
            print(
                f"[plan] rank {rank}: {counts[rank]} files, {loads[rank]} bytes ({format_bytes(loads[rank])})",
                file=self.out,
            )
        print(f"[plan] spread {plan.spread() * 100:.2f}% (busiest rank over the mean)", file=self.out)
        self.out.flush()

    def print_report(self) -> None:
        self.report.stages["total"].seconds = self.cluster.clock() - self.started
        if self.rank != 0:
            return
        for line in report_lines(self.report):
            print(line, file=self.out)
        self.out.flush()
