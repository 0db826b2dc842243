"""The engine: the stages in order, each ending in an agreement of all ranks.

setup -> topology -> list -> diff -> plan -> download -> bcast (+ finalize) -> report.
Each stage's rank-local work is thin glue around the pure core (naming, plan, schedule)
and one I/O module; this file owns only the order and the bookkeeping.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

import numpy as np

from azcp_cluster import manifest
from azcp_cluster.broadcast import Broadcaster
from azcp_cluster.cluster import Cluster, StageOutcome, error_from_payload, error_payload
from azcp_cluster.config import Config, format_bytes
from azcp_cluster.credentials import Authorizer, resolve_credential
from azcp_cluster.download import Downloader, blocks_for, pool_bytes
from azcp_cluster.errors import AzcpError, TopologyError, UsageError, VerifyError
from azcp_cluster.listing import list_source
from azcp_cluster.localfs import ensure_dest, expand_dest, final_path, finalize, prepare, sync_dirs
from azcp_cluster.model import Listing, decode_listing, encode_listing
from azcp_cluster.plan import Plan, plan_transfers
from azcp_cluster.progress import Progress, wants_progress
from azcp_cluster.report import Report, StageFigures, report_lines
from azcp_cluster.schedule import Chunk, bcast_schedule
from azcp_cluster.source import BlobSource, is_url, parse_blob_url


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


def check_topology(places: list[tuple[str, str]]) -> None:
    """Refuse two ranks on one host writing the same DEST (one writer per directory)."""
    seen: dict[tuple[str, str], int] = {}
    for rank, place in enumerate(places):
        if place in seen:
            host, dest = place
            raise TopologyError(
                f"ranks {seen[place]} and {rank} on host '{host}' would both write {dest}; run one rank per node "
                "or put {rank} or {host} in DEST"
            )
        seen[place] = rank


def run(
    cfg: Config,
    comm: Any,
    *,
    env: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    out: TextIO | None = None,
    host: str | None = None,
) -> Report:
    """Run every stage on this rank (collectively with the others in ``comm``).

    Returns the report on every rank; raises the same typed :class:`AzcpError` on every
    rank if any rank fails (the error carries the partial report as ``.report``).
    """
    env = os.environ if env is None else env
    out = sys.stdout if out is None else out
    cluster = Cluster(comm, clock)
    report = Report(ranks=cluster.size, dry_run=cfg.dry_run)
    started = clock()
    try:
        _Run(cfg, cluster, report, env, wall, out, host or socket.gethostname(), started).execute()
    except AzcpError as exc:
        report.stages["total"].seconds = clock() - started
        cluster.close()
        raise _attach(exc, report) from None
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
    ) -> None:
        self.started = started
        self.cfg = cfg
        self.cluster = cluster
        self.report = report
        self.env = env
        self.wall = wall
        self.out = out
        self.host = host
        self.rank = cluster.rank
        self.dest = os.path.abspath(expand_dest(cfg.dest, self.rank, host))
        # Symlinks and "..": two spellings of one directory are still one directory.
        self.dest_identity = os.path.realpath(self.dest)
        self.show_progress = wants_progress(cfg.progress, self.rank)
        self._warned_direct = False
        # Filled in by the stages, in order: list, diff, bcast.
        self._list_seconds = 0.0
        self.have: np.ndarray = np.zeros(0, dtype=bool)  # per file: this rank already has it
        self.streamed_md5: dict[int, str] = {}  # --verify: file index -> MD5 hashed in flight

    def execute(self) -> None:
        source, auth = self.setup()
        listing = self.list_stage(source, auth)
        transfer, holders = self.diff(listing)
        plan = plan_transfers([f.size for f in listing.files], holders, self.cluster.size, self.cfg.shard_size)
        self.report.plan_loads = plan.loads()
        self.report.plan_spread = plan.spread()
        self.report.broadcast_shards = len(plan.shards)
        if self.cfg.dry_run:
            self.print_plan(listing, transfer, plan)
            self.print_report()
            return
        schedule = bcast_schedule(plan, self.cfg.bcast_chunk)
        broadcaster = self.allocate(listing, schedule)
        self.download(listing, transfer, plan, auth)
        self.bcast(schedule, broadcaster)
        if self.cfg.verify:
            self.verify(listing, transfer)  # before the rename: a mismatch leaves no final name
        self.finish(listing, transfer)
        self.record(listing, transfer)
        self.print_report()

    # -- stages ---------------------------------------------------------------------------

    def setup(self) -> tuple[BlobSource, Authorizer]:
        cluster = self.cluster
        outcome = StageOutcome()
        t0 = cluster.clock()
        source: BlobSource | None = None
        auth: Authorizer | None = None
        with cluster.stage(outcome):
            self.cfg.validate()
            if not is_url(self.cfg.source):
                raise UsageError(
                    f"SOURCE {self.cfg.source!r} is not a blob URL (expected https://ACCOUNT.blob.core.windows.net/"
                    "CONTAINER[/PREFIX] or http(s)://HOST:PORT/ACCOUNT/CONTAINER[/PREFIX])"
                )
            source = parse_blob_url(self.cfg.source)
            if not self.cfg.dry_run:
                self.cfg.check_memory(available_memory(), pool_bytes(self.cfg.concurrency))
            auth = Authorizer(source, resolve_credential(source, self.env), self.wall)
        cluster.conclude(t0, outcome)
        assert source is not None and auth is not None
        places = cluster.allgather((self.host, self.dest_identity))
        self.report.nodes = len({h for h, _ in places})
        check_topology(places)
        outcome = StageOutcome()
        with cluster.stage(outcome):
            ensure_dest(self.dest, create=not self.cfg.dry_run)
        cluster.conclude(t0, outcome)
        return source, auth

    def list_stage(self, source: BlobSource, auth: Authorizer) -> Listing:
        cluster = self.cluster
        t0 = cluster.clock()
        payload: bytes | None = None
        outcome = StageOutcome()
        if self.rank == 0:
            with cluster.stage(outcome):
                payload = encode_listing(list_source(source, auth, self.cfg))
        payload, failure = cluster.bcast_object((payload, error_payload(outcome.error) if outcome.error else None))
        if failure is not None:
            raise error_from_payload(failure)
        listing = decode_listing(payload)
        self._list_seconds = cluster.clock() - t0
        self.report.files = len(listing.files)
        self.report.bytes = listing.total_bytes
        self.report.markers_skipped = listing.markers_skipped
        self.report.filtered_out = listing.filtered_out
        self.report.stages["list"] = StageFigures(self._list_seconds, 0)
        return listing

    def diff(self, listing: Listing) -> tuple[list[int], list[list[int]]]:
        """Which files to transfer, and for each file the ranks that already have it."""
        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        files = listing.files
        with cluster.stage(outcome):
            present = np.array(manifest.present(self.dest, files, self.cfg.compare), dtype=bool)
            outcome.stats = {"present": np.packbits(present).tobytes(), "list_seconds": self._list_seconds}
        result = cluster.conclude(t0, outcome)
        matrix = np.stack(
            [
                np.unpackbits(np.frombuffer(stats["present"], dtype=np.uint8), count=len(files)).astype(bool)
                for stats in result.stats
            ]
        )  # ranks x files
        self.have = matrix[self.rank]
        everywhere = matrix.all(axis=0)
        transfer = [int(i) for i in np.flatnonzero(~everywhere)]
        holders = [[int(r) for r in np.flatnonzero(matrix[:, i])] for i in range(len(files))]
        report = self.report
        report.stages["list"].seconds = max(s["list_seconds"] for s in result.stats)
        report.skipped_files = len(files) - len(transfer)
        report.skipped_bytes = sum(files[i].size for i in np.flatnonzero(everywhere))
        report.transfer_files = len(transfer)
        report.peer_files = sum(1 for i in transfer if holders[i])
        report.azure_files = report.transfer_files - report.peer_files
        report.stages["diff"] = StageFigures(result.seconds, 0)
        return transfer, holders

    def download(self, listing: Listing, transfer: list[int], plan: Plan, auth: Authorizer) -> None:
        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        mine = plan.owned_by(self.rank)
        progress = Progress("download", sum(s.length for s in mine), self.show_progress)
        with cluster.stage(outcome):
            for index in self.missing_here(transfer):
                entry = listing.files[index]
                prepare(self.dest, entry.path, entry.size)
            downloader = Downloader(
                listing.files, self.dest, auth, self.cfg, peer_failed=cluster.peer_failed, on_bytes=progress.add
            )
            stats = downloader.run(blocks_for(mine, self.cfg.block_size))
            outcome.stats = {
                "bytes": stats.bytes,
                "retries": stats.retries,
                "causes": dict(stats.retry_causes),
                "refused": stats.direct_refused,
            }
        progress.close()
        if outcome.error is not None:
            cluster.signal_failure(outcome)
        result = cluster.conclude(t0, outcome)
        causes: Counter[str] = Counter()
        for stats_of_rank in result.stats:
            causes.update(stats_of_rank.get("causes", {}))
        self.report.downloaded_bytes = result.total("bytes")
        self.report.retries = result.total("retries")
        self.report.retry_causes = dict(causes)
        self.warn_direct(result.stats)
        self.report.stages["download"] = StageFigures(result.seconds, self.report.downloaded_bytes)

    def allocate(self, listing: Listing, schedule: list[Chunk]) -> Broadcaster | None:
        """Allocate the broadcast slots once, at start-up, in an agreement of their own.

        A rank that cannot get its memory fails here, before anything is downloaded, and
        never stays out of the Ibcasts the others have entered.
        """
        if not schedule:
            return None  # nothing to send: a rerun stays cheap
        cluster = self.cluster
        outcome = StageOutcome()
        broadcaster: Broadcaster | None = None
        with cluster.stage(outcome):
            broadcaster = Broadcaster(
                cluster.comm,
                listing.files,
                self.dest,
                max(c.length for c in schedule),  # no slot larger than the largest chunk
                pipeline=min(self.cfg.bcast_pipeline, len(schedule)),
                writers=self.cfg.bcast_writers,
                direct=self.cfg.bcast_direct,
                have=self.have.tolist(),
                verify=self.cfg.verify,
            )
        cluster.conclude(cluster.clock(), outcome)
        return broadcaster

    def bcast(self, schedule: list[Chunk], broadcaster: Broadcaster | None) -> None:
        """Fan every byte out to every rank (temporary names only; see finish)."""
        if broadcaster is None:
            return
        cluster = self.cluster
        t0 = cluster.clock()
        total = sum(c.length for c in schedule)
        progress = Progress("bcast", total, self.show_progress)
        broadcaster.on_bytes = progress.add
        outcome = StageOutcome()
        with cluster.stage(outcome):
            stats = broadcaster.run(schedule)
            self.streamed_md5 = broadcaster.digests
            outcome.stats = {"refused": stats.direct_refused}
        progress.close()
        result = cluster.conclude(t0, outcome)
        self.report.broadcast_bytes = total
        self.warn_direct(result.stats)
        self.report.stages["bcast"] = StageFigures(result.seconds, total)

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

    def finish(self, listing: Listing, transfer: list[int]) -> None:
        """fsync and rename, only once every rank has every byte (counted in the bcast stage)."""
        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        with cluster.stage(outcome):
            self.finalize(listing, transfer)
            # ru_maxrss is in KiB on Linux: the rank's peak resident memory of the whole run.
            outcome.stats = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        result = cluster.conclude(t0, outcome)
        self.report.stages["bcast"].seconds += result.seconds
        self.report.peak_rss_bytes = max(int(st.get("rss", 0)) for st in result.stats)

    def verify(self, listing: Listing, transfer: list[int]) -> None:
        """Compare every file's MD5 across ranks and with the blob's Content-MD5 (exit 7 on a mismatch)."""
        cluster = self.cluster
        t0 = cluster.clock()
        outcome = StageOutcome()
        files = listing.files
        with cluster.stage(outcome):
            digests = dict(self.streamed_md5)
            moved = set(transfer)
            for i in transfer:
                if files[i].size == 0:
                    digests[i] = EMPTY_MD5
            # Files nobody transferred were not streamed: read them back, several at once.
            skipped = [i for i in range(len(files)) if i not in moved]
            with ThreadPoolExecutor(max_workers=4, thread_name_prefix="azcp-md5") as pool:
                for i, digest in zip(
                    skipped,
                    pool.map(lambda i: manifest.md5_of(final_path(self.dest, files[i].path)), skipped),
                    strict=True,
                ):
                    digests[i] = digest
            outcome.stats = {"md5": digests}
        result = cluster.conclude(t0, outcome)
        for i, entry in enumerate(files):
            seen = [stats["md5"].get(i, "") for stats in result.stats]
            expected = entry.content_md5 or Counter(seen).most_common(1)[0][0]
            bad = [rank for rank, digest in enumerate(seen) if digest != expected]
            if bad:
                ranks = ", ".join(map(str, bad))
                against = "the blob's Content-MD5" if entry.content_md5 else "the other ranks"
                raise VerifyError(f"MD5 on rank(s) {ranks} differs from {against}", path=entry.path)
        self.report.verified_files = len(files)
        self.report.stages["verify"] = StageFigures(result.seconds, self.report.bytes)

    def record(self, listing: Listing, transfer: list[int]) -> None:
        """Update every rank's manifest with what is now known to be in DEST.

        Copied files are the listed version. A skipped file is only known to be the listed
        version if its ETag or MD5 was checked; after a size check its entry stays as it was.
        """
        cluster = self.cluster
        outcome = StageOutcome()
        files = listing.files
        known = files if self.cfg.compare in ("etag", "md5") else [files[i] for i in transfer]
        with cluster.stage(outcome):
            manifest.save(self.dest, known, manifest.load(self.dest))
        cluster.conclude(cluster.clock(), outcome)

    def missing_here(self, transfer: list[int]) -> list[int]:
        """The transferred files this rank does not have yet (it writes and renames these)."""
        return [i for i in transfer if not self.have[i]]

    def finalize(self, listing: Listing, transfer: list[int]) -> None:
        """fsync and rename every transferred file, several at once (fsync waits on the disk)."""
        paths = [listing.files[i].path for i in self.missing_here(transfer)]
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="azcp-fin") as pool:
            list(pool.map(lambda rel: finalize(self.dest, rel), paths))
        dirs = {os.path.dirname(final_path(self.dest, rel)) for rel in paths}
        sync_dirs(sorted(dirs))

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
