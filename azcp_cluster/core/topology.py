"""Who writes, who downloads, who reads: ranks grouped by node. Pure code.

Ranks that run on the same machine and whose DEST is the same directory form one *group*
(one copy of the dataset). The same machine: the same kernel (its boot id, which every
container and namespace of a machine shares; the host name where it cannot be read). The
same directory: the same device and inode, so two paths to one directory (a symbolic link,
a bind mount, two containers mounting one host directory at different places) are one node.
A DEST inside another node's DEST on the same machine is refused (:func:`check_nesting`):
each node's files would land among the other's.

One rank per group, its *leader*, checks DEST, takes part in the broadcast and writes every
received byte; the broadcast runs between leaders only. Any rank may download: it writes its
ranges straight into its group's temporary files (the same directory, on the same machine),
and its leader broadcasts them from there.

With one rank per node every rank is its own group and leader, as in the reference tool;
with ``{rank}`` in DEST one machine stands in for several nodes, one group per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from azcp_cluster.core.errors import TopologyError, UsageError


class Place(NamedTuple):
    """Where one rank runs and writes (localfs.machine_id and localfs.locate_dest say it)."""

    host: str  # its host name (the [cluster] line counts these)
    machine: str = ""  # its kernel's boot id ("" unknown: the host name stands in)
    directory: str = ""  # DEST's device and inode on that machine (see localfs.locate_dest)
    mount: str = ""  # the device of the filesystem DEST is on ("" unknown)
    within: str = ""  # DEST's path inside that filesystem (its real path where unknown)
    dest: str = ""  # DEST as the rank spells it, for messages

    @property
    def node(self) -> tuple[str, str]:
        """What makes two ranks one node: the same machine and the same directory."""
        return (self.machine or f"host {self.host}", self.directory)

    def same_machine(self, other: Place) -> bool:
        """Whether ``other`` runs on this rank's machine (device and inode numbers mean the same)."""
        return self.node[0] == other.node[0]


@dataclass(frozen=True)
class Topology:
    """The roles of every rank, identical on every rank."""

    group_of: tuple[int, ...]  # world rank -> group index (groups in order of their lowest rank)
    leaders: tuple[int, ...]  # group index -> world rank of its leader
    downloaders: tuple[int, ...]  # world ranks that fetch from Azure, ascending
    hosts: int  # distinct host names

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.group_of)

    @property
    def groups(self) -> int:
        """Number of copies being written (one per group)."""
        return len(self.leaders)

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` writes its group's DEST and takes part in the broadcast."""
        return self.leaders[self.group_of[rank]] == rank

    def members(self, group: int) -> list[int]:
        """World ranks of ``group``, ascending."""
        return [r for r, g in enumerate(self.group_of) if g == group]


def lanes_of(topo: Topology) -> tuple[int, ...]:
    """Each rank's place among its node's ranks: its leader 0, the others in world-rank order
    (the order of the node's own communicator, ``group_comm``)."""
    lanes = [0] * topo.size
    for group, leader in enumerate(topo.leaders):
        others = [r for r in topo.members(group) if r != leader]
        for lane, rank in enumerate(others, start=1):
            lanes[rank] = lane
    return tuple(lanes)


def rail_count(topo: Topology, movers: Sequence[int]) -> int:
    """How many chains the fan-out runs (one per rail: lane i of every node in chain i), from the
    ranks that bring bytes into the run (``movers``: the downloaders, or a local SOURCE's readers).

    Several when every node has the same number of ranks, at least two, on two nodes or more,
    and every rank of a node that brings bytes in brings them (each rail's chain carries what
    its own ranks downloaded or read); else one, the leaders' chain, as with one rank per node.
    """
    sizes = {len(topo.members(group)) for group in range(topo.groups)}
    if topo.groups < 2 or len(sizes) != 1:
        return 1
    size = sizes.pop()
    moving = set(movers)
    groups = {topo.group_of[r] for r in moving}
    if size < 2 or not moving or any(not set(topo.members(g)) <= moving for g in groups):
        return 1
    return size


def group_ranks(
    places: Sequence[Place],
    *,
    preferred_leader: int | None = None,
    download_ranks: int | None = None,
    readers: Sequence[int] = (),
) -> Topology:
    """Group ranks by machine and DEST directory (:attr:`Place.node`) and choose the leaders
    and the downloaders.

    ``places[r]`` is where rank ``r`` runs and writes. The leader of a group is its
    lowest rank, except that ``preferred_leader`` (the rank that reads a local source)
    leads its own group: only it may open the source, and the reader must broadcast. So
    does each of ``readers`` (``--source-readers``: one per group, see :func:`choose_readers`).

    ``download_ranks`` (default: all) limits the downloaders; they are taken round-robin
    over the groups (every group's first rank, then every group's second, ...) so the
    requests and the disk writes spread over the nodes. With one rank per node this is
    ranks ``0..K-1``, as in the reference tool.
    """
    if not places:
        raise ValueError("no ranks")
    size = len(places)
    if preferred_leader is not None and not 0 <= preferred_leader < size:
        raise UsageError(f"--source-rank {preferred_leader} is not a rank of this job (0..{size - 1})")
    if download_ranks is not None and download_ranks < 1:
        raise UsageError(f"--download-ranks must be at least 1 (got {download_ranks})")
    group_of, members = _groups(places)
    leaders = [m[0] for m in members]
    for reader in (*readers, *(() if preferred_leader is None else (preferred_leader,))):
        leaders[group_of[reader]] = reader
    round_robin = _round_robin(leaders, members)
    chosen = round_robin if download_ranks is None else round_robin[: min(download_ranks, size)]
    return Topology(
        group_of=tuple(group_of),
        leaders=tuple(leaders),
        downloaders=tuple(sorted(chosen)),
        hosts=len({place.host for place in places}),
    )


def _groups(places: Sequence[Place]) -> tuple[list[int], list[list[int]]]:
    """Each rank's group (numbered by first appearance of its :attr:`Place.node`) and each
    group's ranks, ascending."""
    index: dict[tuple[str, str], int] = {}
    group_of = []
    for place in places:
        group_of.append(index.setdefault(place.node, len(index)))
    members: list[list[int]] = [[] for _ in index]
    for rank, group in enumerate(group_of):
        members[group].append(rank)
    return group_of, members


def _round_robin(leaders: Sequence[int], members: Sequence[Sequence[int]]) -> list[int]:
    """Every rank, round-robin over the groups: each group's leader first, then every group's
    next rank, and so on; the first K are the downloaders of ``--download-ranks K``, spread
    over the nodes."""
    ordered = [[leaders[g], *(r for r in members[g] if r != leaders[g])] for g in range(len(members))]
    return [m[depth] for depth in range(max(len(m) for m in ordered)) for m in ordered if depth < len(m)]


def check_nesting(places: Sequence[Place], group_of: Sequence[int]) -> None:
    """Refuse a DEST that lies inside another node's DEST on the same machine (a link or a
    mount into a directory of it): each node's files, lock, manifest and journal would land
    among the other's (exit 2, as for one DEST shared by two machines). Decided by the
    directories' paths inside their filesystem (:attr:`Place.within`), whichever path or
    mount each rank reaches its DEST through; the same path there is one directory.
    """
    inside: dict[tuple[str, str], dict[str, int]] = {}  # (machine, filesystem) -> path -> a rank
    for rank, place in enumerate(places):
        inside.setdefault((place.node[0], place.mount), {}).setdefault(place.within, rank)
    for rank, place in enumerate(places):
        paths = inside[(place.node[0], place.mount)]
        parts = place.within.rstrip("/").split("/")
        ancestors = ("/".join(parts[:i]) or "/" for i in range(len(parts) - 1, 0, -1))
        for outer in (paths[place.within], *(paths.get(path) for path in ancestors)):
            if outer is not None and group_of[outer] != group_of[rank]:
                raise _nested(places, rank, outer)


def _nested(places: Sequence[Place], inner: int, outer: int) -> TopologyError:
    """The error for rank ``inner``'s DEST inside (or at) rank ``outer``'s, worded by what is known."""
    here, there = places[inner], places[outer]
    where = "on the same host" if here.host == there.host else f"on the same machine (host {there.host})"
    if here.within == there.within:  # one path in one filesystem, yet not one inode: mounted over?
        what = f"DEST is, inside its filesystem, the directory of rank {outer}'s DEST {there.dest} {where}, "
        what += "yet not by device and inode (a mount over one of them?)"
    else:
        what = f"DEST lies inside rank {outer}'s DEST {there.dest} {where}"
    return TopologyError(
        f"{what}: each node's files would land among the other's; give each node a directory of its own, "
        "side by side (e.g. /scratch/copy{rank})",
        path=here.dest,
        rank=inner,
    )


def choose_reader(sees: Sequence[bool], requested: int | None, source: str) -> int:
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


def choose_readers(sees: Sequence[bool], places: Sequence[Place], count: int) -> list[int]:
    """``--source-readers``: the lowest rank that sees SOURCE on each of the first ``count`` nodes
    (``places``, as for :func:`group_ranks`) that see it, ascending."""
    chosen: list[int] = []
    nodes: set[tuple[str, str]] = set()
    for rank, seen in enumerate(sees):
        place = places[rank].node
        if seen and place not in nodes:
            nodes.add(place)
            chosen.append(rank)
            if len(chosen) == count:
                return chosen
    if not chosen:
        raise UsageError("SOURCE is neither a blob URL nor a path that exists on any rank")
    raise TopologyError(
        f"--source-readers {count}: only {len(chosen)} node(s) see SOURCE (ranks {', '.join(map(str, chosen))})"
    )


AUTO_WORKERS_MAX = 8  # auto never starts more download workers than this per rank
# Auto: below this share, workers cannot pay for their start (WORKER_START_SECONDS) even if
# they were infinitely fast, at the slowest rate a rank downloads at (HTTPS on a slow core).
AUTO_MIN_SHARE = 128 * 1024 * 1024
# Auto (handover_workers): a rank that keeps this many cores busy while it downloads alone is
# CPU-bound (the event loop, TLS); below it, the network or the server sets the pace and more
# processes would only fight over it.
CPU_BOUND = 0.85
# What handing the rest to workers costs: the rank's requests in flight drain, then the workers
# start (an interpreter each, its imports, its buffers mapped) and connect: counted above what
# it was measured at (docs/benchmarks.md).
WORKER_START_SECONDS = 0.5
# Workers must be predicted to finish in at most this share of the time the rank alone would:
# the prediction assumes each worker goes as fast as the rank did, which the network may not allow.
HANDOVER_GAIN = 0.8


def workers_for(requested: int | None, cpus: int, sharing: int, share: int) -> int:
    """How many download worker processes a rank may use (1: the rank downloads itself).

    ``requested``: ``--download-workers N``, used as given. Auto (None): the most it may start,
    should it find that they pay (:func:`handover_workers`): the ``cpus`` it may use over the
    ``sharing`` ranks that download with them, at most :data:`AUTO_WORKERS_MAX`; 1 for a share
    under :data:`AUTO_MIN_SHARE`, which workers cannot shorten.
    """
    if share <= 0:
        return 1
    if requested is not None:
        return max(1, requested)
    if share < AUTO_MIN_SHARE:
        return 1
    return max(1, min(cpus // max(1, sharing), AUTO_WORKERS_MAX))


def handover_workers(left: int, rate: float, own: float, idle: float | None, sharing: int, most: int) -> int:
    """Auto download workers: how many to hand the rest of a rank's download to (0: the rank keeps it).

    Measured while the rank downloaded alone: ``rate`` (bytes per second), ``own`` (the cores the
    rank kept busy) and ``idle`` (the idle cores among those it may use; None: unknown), with
    ``left`` bytes still to fetch and ``sharing`` downloading ranks on the host. The model: only a
    CPU-bound rank (``own`` >= :data:`CPU_BOUND`) goes faster on more processes; each worker then
    goes at ``rate``, on the rank's own core and its part of the idle ones; starting them costs
    :data:`WORKER_START_SECONDS`. Workers are taken when the predicted time is at most
    :data:`HANDOVER_GAIN` of the rank's alone: ``start + left / (rate * k) <= gain * left / rate``.
    """
    if idle is None or rate <= 0 or left <= 0 or own < CPU_BOUND:
        return 0
    k = min(most, int(own + idle / max(1, sharing)))
    if k < 2:  # one worker is the rank itself, plus a process to start
        return 0
    alone = left / rate
    with_workers = WORKER_START_SECONDS + left / (rate * k)
    return k if with_workers <= HANDOVER_GAIN * alone else 0
