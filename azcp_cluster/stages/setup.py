"""The setup stage: check the arguments, find the readers, group the ranks by node, take DEST.

Returns a frozen :class:`Placement` (who leads, downloads and reads) and the run's
:class:`~azcp_cluster.azure.credentials.Authorizer` for a blob SOURCE.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from azcp_cluster.azure.proxies import Proxy, proxy_for
from azcp_cluster.core.config import json_inside_dest
from azcp_cluster.core.errors import LocalFSError, LockError, ReportPathError, TopologyError
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.core.topology import (
    Place,
    Topology,
    check_nesting,
    choose_reader,
    choose_readers,
    group_ranks,
    lanes_of,
    rail_count,
)
from azcp_cluster.dest.destlock import DestLock, lock_backoff
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.localfs import ensure_dest, locate_dest, machine_id
from azcp_cluster.dest.localsource import check_overlap
from azcp_cluster.run import figures
from azcp_cluster.run.cluster import StageOutcome
from azcp_cluster.run.console import say
from azcp_cluster.run.rails import RAIL_DEVICE_ENV, local_size
from azcp_cluster.stages.context import RunContext, log_path_for

if TYPE_CHECKING:
    from azcp_cluster.azure.credentials import Authorizer


@dataclass(frozen=True)
class Placement:
    """The roles of this run's ranks, the same on every rank (see topology.py)."""

    topo: Topology
    group: int  # this rank's node (its group of ranks: one copy of the dataset)
    leader: bool  # this rank writes its node's DEST and takes part in the fan-out
    reader: int  # lists the source (and reads it, when it is local)
    readers: tuple[int, ...]  # a local SOURCE: every rank that reads it (--source-readers); else ()
    auth: Authorizer | None  # a blob SOURCE: the run's credential, no token yet
    proxy: Proxy | None = None  # a blob SOURCE: the proxy its ranged GETs go through (proxies.py)
    downloaders_on_host: int = 1  # downloading ranks of this job on this rank's host (they share its CPUs)
    # The fan-out's chains: one per rail, lane i of every node in chain i (topology.rail_count);
    # with one, the leaders' chain. This rank's lane: its place among its node's ranks.
    rails: int = 1
    lane: int = 0
    # The ranks that bring the bytes in (the plan's owners): the downloaders, or a local SOURCE's
    # readers (with several rails, every rank of a reader's node: each reads its own shards).
    owners: tuple[int, ...] = ()

    def downloaders_here(self) -> list[int]:
        """The ranks of this node that download (ascending)."""
        return [r for r in self.topo.downloaders if self.topo.group_of[r] == self.group]

    @property
    def fans_out(self) -> bool:
        """This rank takes part in the fan-out (a chain of its rail): every rank with several rails, else the leader."""
        return self.leader or self.rails > 1


def ranks_here(ctx: RunContext) -> int:
    """How many ranks share this machine's memory, as the launcher says (1 where none says)."""
    return local_size(ctx.env) or 1


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


def setup(ctx: RunContext) -> Placement:
    """Check the arguments, find the readers, group the ranks by node, create and lock DEST.

    Two agreements: every rank's place (host, real DEST) and whether it sees a local SOURCE
    first; then the roles computed from them on every rank alike.
    """
    cluster = ctx.cluster
    cfg = ctx.cfg
    outcome: StageOutcome[tuple[tuple[str, ...], bool, str, tuple[int, int] | None]] = StageOutcome()
    t0 = cluster.clock()
    auth: Authorizer | None = None
    proxy: Proxy | None = None
    sees = False
    with cluster.stage(outcome):
        auth, proxy, sees = _check_arguments(ctx)
        # The fabric device --rails bound this rank to before MPI started (run/rails.py), for the report.
        outcome.stats = (place_of(ctx), sees, ctx.env.get(RAIL_DEVICE_ENV, ""), _source_id(ctx) if sees else None)
    result = cluster.conclude(t0, outcome, stage="setup")
    seen = result.each(((), False, "", None))
    places = [Place(*place) for place, _, _, _ in seen]
    made_here: StageOutcome[list[str]] = StageOutcome()
    t1 = cluster.clock()
    readers: list[int] = []
    topo = Topology(group_of=(0,), leaders=(0,), downloaders=(0,), hosts=1)
    leader = False
    with cluster.stage(made_here):
        readers, topo = _roles(ctx, [sees for _, sees, _, _ in seen], places)
        leader = topo.is_leader(ctx.rank)
        if ctx.local:  # on every rank: each knows only its own DEST
            check_overlap(os.path.realpath(ctx.source_root), ctx.dest_identity)
        _check_outside_dest(ctx)
        if leader:
            open_dest(ctx)
        made_here.stats = list(ctx.dest_made.paths)
    cluster.note("roles", t1)
    made = cluster.conclude(t0, made_here)
    reader = readers[0] if ctx.local else 0
    _share_made(ctx, places, made.each([]))
    if not cfg.dry_run:
        lock_dest(ctx, leader, t0, places)
    owners, rails = _movers(ctx, topo, readers, [source for _, _, _, source in seen])
    lane = lanes_of(topo)[ctx.rank] if rails > 1 else 0  # one chain: every rank's is the leaders' rail
    _split(ctx, topo, leader, lane if rails > 1 else None)
    _report_roles(ctx, topo, reader, readers, tuple(device for _, _, device, _ in seen))
    on_host = sum(1 for r in topo.downloaders if places[r][0] == ctx.host)
    return Placement(
        topo=topo,
        group=topo.group_of[ctx.rank],
        leader=leader,
        reader=reader,
        readers=tuple(readers),
        auth=auth,
        proxy=proxy,
        downloaders_on_host=max(1, on_host),
        rails=rails,
        lane=lane,
        owners=owners,
    )


def _check_outside_dest(ctx: RunContext) -> None:
    """The JSON report and the log file lie outside DEST (each rank's own DEST), the log file
    outside a local SOURCE too (its lines would be copied as data), and the two are not one
    file: exit 2 otherwise. A log file only rank 0 writes (no ``{rank}`` in it) is checked on
    every rank, as the JSON report is: it may lie in another node's DEST."""
    json_path = ctx.cfg.json_path
    if json_path and json_inside_dest(os.path.realpath(json_path), ctx.dest_identity):
        raise ReportPathError(f"--json {json_path} lies inside DEST; write the report outside it")
    log = ctx.console.log_path or log_path_for(ctx.cfg.log_file, 0, ctx.host)
    if not log:
        return
    log_real = os.path.realpath(log)
    refused = None
    if json_inside_dest(log_real, ctx.dest_identity):
        refused = "lies inside DEST; write the log outside it"
    elif ctx.local and json_inside_dest(log_real, os.path.realpath(ctx.source_root)):
        refused = "lies inside SOURCE; write the log outside it"
    elif json_path and os.path.realpath(json_path) == log_real:
        refused = "is the --json report's file; give each its own"
    if refused:
        ctx.console.refuse_log()  # not even for the lines of the run it ends
        raise ReportPathError(f"--log-file {log} {refused}")


def _split(ctx: RunContext, topo: Topology, leader: bool, lane: int | None) -> None:
    """The run's two communicators (collective on every rank), each ordered by group: the
    fan-out's (each rail's ``lane`` of every node, rail 0 the leaders; one rail, ``lane``
    None: the leaders', the others one they never use), and the node's own ranks, its leader
    first (it hands them the identities of the temporary files it made)."""
    comm, group = ctx.cluster.comm, topo.group_of[ctx.rank]
    node_comm = comm.Split(lane if lane is not None else (0 if leader else 1), group)
    ctx.split(node_comm, comm.Split(group, 0 if leader else ctx.rank + 1))


def _share_made(ctx: RunContext, places: list[Place], made: list[list[str]]) -> None:
    """DESTs side by side below directories this run made (``made``: each rank's): whichever
    leader of the machine is the last to remove its own DEST (a failed run) removes the
    parents too, if empty."""
    here = places[ctx.rank]
    beside = [paths for rank, paths in enumerate(made) if rank != ctx.rank and places[rank].same_machine(here)]
    ctx.dest_made.shared = {path for paths in beside for path in paths}


def _check_arguments(ctx: RunContext) -> tuple[Authorizer | None, Proxy | None, bool]:
    """This rank's part of the first agreement: the arguments and the memory checked, and a
    local SOURCE looked for (whether this rank sees it) or a blob SOURCE's credential and
    proxy resolved (the run's :class:`Authorizer`, no token yet)."""
    cfg = ctx.cfg
    if ctx.local:
        sees = False
        # With --source-rank, only that rank looks: a shared filesystem sees one client.
        if cfg.source_rank in (None, ctx.rank):
            sees = os.path.exists(ctx.source_root)
        if not cfg.dry_run:
            cfg.check_memory(available_memory(), 0, ranks_here(ctx))
        return None, None, sees
    # Imported here: a local SOURCE never pays for the Azure and HTTP libraries.
    from azcp_cluster.azure.credentials import Authorizer, resolve_credential
    from azcp_cluster.core.blocks import pool_bytes

    source = parse_blob_url(cfg.source)
    if not cfg.dry_run:
        cfg.check_memory(available_memory(), pool_bytes(cfg.concurrency), ranks_here(ctx))
    credential = resolve_credential(source, ctx.env, cfg.auth, ctx.credential)
    if ctx.rank == 0:  # -v: which credential the run sends (its origin, never the secret)
        ctx.console.note(f"azcp-cluster: credential: {credential.origin} ({credential.kind})", "detail")
    auth = Authorizer(source, credential, ctx.wall)
    proxy = proxy_for(source.endpoint, ctx.env)  # a proxy variable that cannot be used: exit 2 here
    return auth, proxy, False


def _roles(ctx: RunContext, sees_all: list[bool], places: list[Place]) -> tuple[list[int], Topology]:
    """The readers of a local SOURCE (none for a blob SOURCE) and the ranks grouped by node,
    computed from the first agreement on every rank alike (so a nesting error is the same
    everywhere)."""
    cfg = ctx.cfg
    readers: list[int] = []
    if ctx.local:
        if cfg.source_readers > 1:
            readers = choose_readers(sees_all, places, cfg.source_readers)
        else:
            readers = [choose_reader(sees_all, cfg.source_rank, cfg.source)]
    topo = group_ranks(
        places,
        preferred_leader=readers[0] if ctx.local else None,
        download_ranks=cfg.download_ranks,
        readers=readers,
    )
    check_nesting(places, topo.group_of)  # on every rank alike: the same error everywhere
    return readers, topo


def _source_id(ctx: RunContext) -> tuple[int, int] | None:
    """The device and inode of the local SOURCE this rank sees (its links followed), or None."""
    try:
        st = os.stat(ctx.source_root)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _movers(
    ctx: RunContext, topo: Topology, readers: list[int], sources: list[tuple[int, int] | None]
) -> tuple[tuple[int, ...], int]:
    """The plan's owners and the fan-out's rails (``--rails off``: one). A local SOURCE's readers,
    with several rails, are every rank of a reader's node that sees the very SOURCE its reader
    sees (``sources``: each rank's, device and inode; another tree at the same path, a
    container's own, never counts): each reads its own shards and sends them on its rail (the
    source is still read once)."""
    if not ctx.local:
        owners = tuple(topo.downloaders)
    else:
        reader_of = {topo.group_of[r]: r for r in readers}
        seeing = tuple(
            r
            for g in sorted(reader_of)
            for r in topo.members(g)
            if r == reader_of[g] or (sources[r] is not None and sources[r] == sources[reader_of[g]])
        )
        owners = seeing if ctx.cfg.rails != "off" and rail_count(topo, seeing) > 1 else tuple(readers)
    rails = 1 if ctx.cfg.rails == "off" else rail_count(topo, owners)
    return owners, rails


def _report_roles(ctx: RunContext, topo: Topology, reader: int, readers: list[int], devices: tuple[str, ...]) -> None:
    """The roles in the run's report (``devices``: per rank, the fabric device it is bound to)."""
    download_ranks = 0 if ctx.local else len(topo.downloaders)
    source_rank = reader if ctx.local else None
    ctx.record(figures.Roles(topo.hosts, topo.groups, download_ranks, source_rank, tuple(readers), devices))


def open_dest(ctx: RunContext) -> None:
    """A leader's DEST: created if missing (remembering what this run made), then opened.

    Another run that made DEST and failed before writing anything removes it again, empty
    (``RunContext.remove_made_dest``); one that does so between the two steps here is met by
    making DEST once more.
    """
    create = not ctx.cfg.dry_run
    for attempt in range(3):
        made = ensure_dest(ctx.dest, create=create)
        if made:
            ctx.dest_made.close()
            ctx.dest_made = made
        try:
            ctx.tree = DestTree(ctx.dest, create=create)
            return
        except LocalFSError:
            if attempt == 2 or os.path.lexists(ctx.dest):
                raise


def place_of(ctx: RunContext) -> tuple[str, ...]:
    """This rank's :class:`~azcp_cluster.core.topology.Place` (as a plain tuple, for the allgather):
    its host, its machine, and where its DEST is on that machine."""
    directory, mount, within = locate_dest(ctx.dest_identity)
    return tuple(Place(ctx.host, machine_id(), directory, mount, within, ctx.dest))


class LockSeen(NamedTuple):
    """A leader's try at its DEST's lock, as the agreement carries it to every rank."""

    held_by: str | None  # who holds it, if not this run's leader
    me: str  # this run's leader, as a lock file names its holder
    dest: str


def lock_dest(ctx: RunContext, leader: bool, t0: float, places: list[Place]) -> None:
    """Every leader takes its DEST's lock, all or none (see destlock.py): try, agree, release, back off.

    Nobody waits while holding a lock, so jobs that share nodes in any order cannot
    deadlock. ``--lock fail`` ends at the first refusal, ``--lock-timeout`` after that
    long (the slowest rank's clock, so every rank decides alike); exit 9.
    """
    cluster = ctx.cluster
    cfg = ctx.cfg
    # The pid alone is not unique (containers have their own pid namespaces): a random
    # token tells this run's ranks from another run's.
    me = f"{ctx.host} pid {os.getpid()}, run {random.getrandbits(32):08x}"
    rng = random.Random()
    attempt = 0
    waited = False
    while True:
        outcome: StageOutcome[LockSeen] = StageOutcome()
        tried = cluster.clock()
        with cluster.stage(outcome):
            outcome.stats = LockSeen(_try_lock(ctx, me) if leader else None, me, ctx.dest)
        cluster.note("lock", tried)
        result = cluster.conclude(t0, outcome)
        seen = result.each(LockSeen(None, "", ""))
        refused = [(rank, st) for rank, st in enumerate(seen) if st.held_by is not None]
        if not refused:
            return
        if ctx.dest_lock is not None:
            ctx.dest_lock.release()
        rank, st = refused[0]
        ours = {other.me: r for r, other in enumerate(seen)}
        if st.held_by in ours:  # two leaders of this run: one directory, two nodes
            other = ours[st.held_by]
            raise TopologyError(shared_dest(places[rank], places[other], other), path=st.dest, rank=rank)
        holder = f"in use by another run (host {st.held_by})"
        if cfg.lock == "fail":
            raise LockError(f"DEST is {holder}; --lock fail", path=st.dest, rank=rank)
        if cfg.lock_timeout is not None and result.seconds >= cfg.lock_timeout:
            raise LockError(
                f"DEST is still {holder} after --lock-timeout {cfg.lock_timeout:g} s", path=st.dest, rank=rank
            )
        if not waited and ctx.rank == 0:
            say(
                f"azcp-cluster: notice: rank {rank}: DEST {st.dest} is {holder}; waiting for it to end "
                "(--lock fail exits instead)"
            )
        waited = True
        time.sleep(lock_backoff(attempt, rng))
        attempt += 1


def _try_lock(ctx: RunContext, me: str) -> str | None:
    """A leader's try at its DEST's lock: None if it holds it now, else who does."""
    assert ctx.tree is not None
    if ctx.tree.removed:  # the run that made DEST failed and removed it, empty: make it again
        if ctx.dest_lock is not None:
            ctx.dest_lock.close()
            ctx.dest_lock = None
        ctx.tree.close()
        open_dest(ctx)
        assert ctx.tree is not None
    if ctx.dest_lock is None:
        ctx.dest_lock = DestLock(ctx.tree, me)
    return ctx.dest_lock.try_acquire()


def shared_dest(here: Place, there: Place, other: int) -> str:
    """Why two nodes' leaders met at one lock file (one DEST directory), in what is known of them.

    Ranks of one machine with one DEST directory are one node, so they are on two machines (or
    two boot ids could not be read), or the directory was swapped while they were placed.
    """
    if here.same_machine(there):
        where = "on the same machine, though it was another directory when the ranks were placed"
        where += " (replaced or mounted over?)"
    elif here.machine and there.machine:
        where = f"on another machine (host {there.host}): a shared filesystem"
    else:  # a boot id that cannot be read: the host names stood in
        where = f"on host {there.host}, which this rank cannot tell from another machine: a shared filesystem?"
    return (
        f"DEST is the same directory as the DEST of rank {other} {where}; give each node a DEST on "
        "its own disk, e.g. with {host}"
    )
