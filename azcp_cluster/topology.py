"""Who writes, who downloads, who reads: ranks grouped by node. Pure code.

Ranks that run on the same host and resolve DEST to the same directory form one *group*
(one copy of the dataset). One rank per group, its *leader*, checks DEST, takes part in
the broadcast and writes every received byte; the broadcast runs between leaders only.
Any rank may download: it writes its ranges straight into its group's temporary files
(the same directory, on the same host), and its leader broadcasts them from there.

With one rank per node every rank is its own group and leader, as in the reference tool;
with ``{rank}`` in DEST one machine stands in for several nodes, one group per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from azcp_cluster.errors import TopologyError, UsageError


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


def group_ranks(
    places: Sequence[tuple[str, str]],
    *,
    preferred_leader: int | None = None,
    download_ranks: int | None = None,
    readers: Sequence[int] = (),
) -> Topology:
    """Group ranks by ``(host, real DEST)`` and choose the leaders and the downloaders.

    ``places[r]`` is rank ``r``'s host name and resolved DEST. The leader of a group is its
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
    index: dict[tuple[str, str], int] = {}
    group_of = []
    for place in places:
        group_of.append(index.setdefault(tuple(place), len(index)))  # type: ignore[arg-type]
    members: list[list[int]] = [[] for _ in index]
    for rank, group in enumerate(group_of):
        members[group].append(rank)
    leaders = [m[0] for m in members]
    for reader in (*readers, *(() if preferred_leader is None else (preferred_leader,))):
        leaders[group_of[reader]] = reader
    # Round-robin over groups, each group's leader first.
    ordered = [[leaders[g], *(r for r in members[g] if r != leaders[g])] for g in range(len(members))]
    round_robin = [m[depth] for depth in range(max(len(m) for m in ordered)) for m in ordered if depth < len(m)]
    chosen = round_robin if download_ranks is None else round_robin[: min(download_ranks, size)]
    return Topology(
        group_of=tuple(group_of),
        leaders=tuple(leaders),
        downloaders=tuple(sorted(chosen)),
        hosts=len({host for host, _ in places}),
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


def choose_readers(sees: Sequence[bool], places: Sequence[tuple[str, str]], count: int) -> list[int]:
    """``--source-readers``: the lowest rank that sees SOURCE on each of the first ``count`` nodes
    (``places``, as for :func:`group_ranks`) that see it, ascending."""
    chosen: list[int] = []
    nodes: set[tuple[str, str]] = set()
    for rank, seen in enumerate(sees):
        place = (places[rank][0], places[rank][1])
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
BYTES_PER_WORKER = 256 * 1024 * 1024  # auto: one worker per this much of the rank's share


def workers_for(requested: int | None, cpus: int, sharing: int, share: int) -> int:
    """How many download worker processes a rank uses (1: the rank downloads itself).

    ``requested``: ``--download-workers`` (None: auto). Auto: the ``cpus`` the rank may use over
    the ``sharing`` ranks that download with them, at most :data:`AUTO_WORKERS_MAX`, and no more than one per
    :data:`BYTES_PER_WORKER` of its ``share`` (a small share is not worth the processes'
    start). Never more workers than there is a share to split.
    """
    if share <= 0:
        return 1
    if requested is not None:
        return max(1, requested)
    per_rank = max(1, cpus // max(1, sharing))
    by_share = max(1, -(-share // BYTES_PER_WORKER))
    return max(1, min(per_rank, AUTO_WORKERS_MAX, by_share))
