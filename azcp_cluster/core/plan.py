"""Deterministic LPT bin-packing of files and byte-range shards onto ranks. Pure code.

Every rank calls :func:`make_plan` with the same inputs and gets the same plan, so the
plan never has to be sent over the network. Files larger than ``shard_size`` are split into
near-equal, aligned byte ranges; all pieces are then placed largest first on the
least-loaded rank (ties to the lowest rank): the classic LPT rule, within 4/3 of optimal.

Column-wise: a plan of a million files is five numpy columns (:class:`ShardColumns`), made
with sorts and an LPT that places pieces in exact batches (:func:`lpt_owners`); its
:class:`Shard` tuples are made only for whoever asks for them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from azcp_cluster.core.columns import distinct, distinct_pairs

# Shard boundaries fall on multiples of this, so O_DIRECT writers never straddle them.
SHARD_ALIGN = 4096
# A plan whose largest download share exceeds the mean by more than 1/BALANCE is planned
# again with shards of 1/BALANCE of the mean share (never under BALANCED_MIN_SHARD, a ranged
# GET's fair size), and the finer plan is kept when its largest share is smaller: four 32 MiB
# files over eight downloaders leave four idle at --shard-size 1GiB; 8 MiB shards keep all
# eight busy, each with two. A ranged GET of a service costs more than nothing, so no finer.
BALANCE = 8
BALANCED_MIN_SHARD = 8 * 1024 * 1024


class Shard(NamedTuple):
    """A byte range ``[offset, offset + length)`` of file ``file`` that rank ``owner`` fetches.

    A named tuple, not a dataclass: a plan of a million files makes a million of them, and a
    frozen dataclass costs several times as much to make (immutable and ordered alike).
    """

    file: int  # index into the listing's files
    offset: int
    length: int
    owner: int
    peer: bool = False  # the owner already has the file: broadcast it, never download it


class ShardColumns(NamedTuple):
    """A plan's shards as columns (read-only numpy arrays, one entry a shard, in the plan's order).

    A million :class:`Shard` tuples cost some 150 MB and a third of a second to make; the
    columns cost 33 bytes a shard, and what the run asks of a plan (loads, a rank's shards,
    the schedule) reads them whole.
    """

    file: np.ndarray  # int64
    offset: np.ndarray  # int64
    length: np.ndarray  # int64
    owner: np.ndarray  # int64
    peer: np.ndarray  # bool


def _frozen(array: np.ndarray, dtype: type, copy: bool = True) -> np.ndarray:
    out: np.ndarray = np.ascontiguousarray(array, dtype=dtype)
    if out is array and copy:
        out = out.copy()  # never share (or freeze) the caller's array
    out.flags.writeable = False
    return out


def _columns_of(shards: Sequence[Shard]) -> ShardColumns:
    def column(index: int, dtype: type) -> np.ndarray:
        return np.fromiter((s[index] for s in shards), dtype=dtype, count=len(shards))

    return ShardColumns(*(_frozen(column(i, t), t) for i, t in enumerate((np.int64,) * 4 + (np.bool_,))))


class Plan:
    """Who fetches what. ``shards`` are sorted by (file, offset): the broadcast order.

    Held as columns (:class:`ShardColumns`); ``shards`` makes the tuples on first use only.
    Immutable; two plans are equal when their shards, ranks and receivers are.
    """

    __slots__ = ("_shards", "columns", "nranks", "receivers")

    _shards: tuple[Shard, ...] | None
    columns: ShardColumns
    nranks: int
    # A peer shard of a file that some nodes hold only in part (a resumed run): the ranks
    # (leaders) that lack it, keyed by (file, offset). Every other shard goes to everyone.
    receivers: Mapping[tuple[int, int], tuple[int, ...]]

    def __init__(
        self,
        shards: Sequence[Shard],
        nranks: int,
        receivers: Mapping[tuple[int, int], tuple[int, ...]] | None = None,
        *,
        columns: ShardColumns | None = None,
    ) -> None:
        shards = tuple(shards)
        set_ = object.__setattr__
        set_(self, "columns", columns if columns is not None else _columns_of(shards))
        set_(self, "_shards", shards if columns is None else None)
        set_(self, "nranks", nranks)
        set_(self, "receivers", receivers if receivers is not None else {})

    @classmethod
    def of_columns(
        cls,
        columns: ShardColumns,
        nranks: int,
        receivers: Mapping[tuple[int, int], tuple[int, ...]] | None = None,
        *,
        copy: bool = True,
    ) -> Plan:
        """A plan of these columns, made read-only (copied first unless ``copy`` is false: the
        caller's own, which it never changes again)."""
        types = (np.int64,) * 4 + (np.bool_,)
        frozen = ShardColumns(*(_frozen(c, t, copy) for c, t in zip(columns, types, strict=True)))
        return cls((), nranks, receivers, columns=frozen)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Plan is immutable: cannot set {name!r}")

    @property
    def shards(self) -> tuple[Shard, ...]:
        """The shards as tuples, in broadcast order (made on first use, then kept)."""
        if self._shards is None:
            c = self.columns
            lists = (c.file.tolist(), c.offset.tolist(), c.length.tolist(), c.owner.tolist(), c.peer.tolist())
            object.__setattr__(self, "_shards", tuple(map(Shard._make, zip(*lists, strict=True))))
        assert self._shards is not None
        return self._shards

    @property
    def shard_count(self) -> int:
        """How many shards (without making them)."""
        return len(self.columns.file)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        mine, theirs = self.columns, other.columns
        return (
            self.nranks == other.nranks
            and dict(self.receivers) == dict(other.receivers)
            and all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, and its receivers are a dict

    def __repr__(self) -> str:
        return f"Plan(shards=<{self.shard_count} shards>, nranks={self.nranks}, receivers=<{len(self.receivers)}>)"

    def loads(self) -> list[int]:
        """Bytes each rank downloads (peer shards cost no download)."""
        c = self.columns
        downloaded = ~c.peer
        loads = np.zeros(self.nranks, dtype=np.int64)
        np.add.at(loads, c.owner[downloaded], c.length[downloaded])
        return [int(load) for load in loads.tolist()]

    def owned_by(self, rank: int) -> list[Shard]:
        """The shards one rank downloads, in broadcast order."""
        c = self.columns
        (mine,) = np.nonzero((c.owner == rank) & ~c.peer)
        if self._shards is not None:
            shards = self._shards
            return [shards[i] for i in mine.tolist()]
        lists = (c.file[mine].tolist(), c.offset[mine].tolist(), c.length[mine].tolist(), c.owner[mine].tolist())
        return [Shard(file, offset, length, owner) for file, offset, length, owner in zip(*lists, strict=True)]

    def downloaded_files(self, owners: Iterable[int]) -> set[int]:
        """The files with bytes that one of ``owners`` downloads (not a peer shard)."""
        c = self.columns
        chosen = np.isin(c.owner, np.fromiter(owners, dtype=np.int64)) & ~c.peer
        return set(distinct(c.file[chosen]).tolist())

    def files_per_rank(self) -> list[int]:
        """How many distinct files each rank has a shard of (downloaded or sent to peers)."""
        c = self.columns
        counts = np.zeros(self.nranks, dtype=np.int64)
        if len(c.file):
            owners, _ = distinct_pairs(c.owner, c.file)
            np.add.at(counts, owners, 1)
        return [int(n) for n in counts.tolist()]

    def spread(self, owners: Sequence[int] | None = None) -> float:
        """Imbalance of the busiest rank over the mean, among ``owners`` (default all): 0.0 is perfect."""
        loads = self.loads()
        chosen = [loads[r] for r in (owners if owners is not None else range(self.nranks))]
        total = sum(chosen)
        if not chosen or total == 0:
            return 0.0
        mean = total / len(chosen)
        return max(chosen) / mean - 1.0


def round_up(value: int, align: int) -> int:
    """Smallest multiple of ``align`` that is >= ``value``."""
    return -(-value // align) * align


def split_ranges(size: int, shard_size: int, align: int = SHARD_ALIGN) -> list[tuple[int, int]]:
    """Split ``size`` bytes into near-equal ``(offset, length)`` ranges of at most ~``shard_size``.

    Boundaries are multiples of ``align`` (when ``shard_size`` allows), every byte is in
    exactly one range, and an empty file gives no range.
    """
    if size <= 0:
        return []
    if size <= shard_size:
        return [(0, size)]
    count = -(-size // shard_size)
    piece = -(-size // count)
    if piece >= align:
        piece = round_up(piece, align)
    ranges = []
    offset = 0
    while offset < size:
        length = min(piece, size - offset)
        ranges.append((offset, length))
        offset += length
    return ranges


def split_columns(
    file: np.ndarray, start: np.ndarray, size: np.ndarray, shard_size: int, align: int = SHARD_ALIGN
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`split_ranges` of many byte ranges at once: ``size[i]`` bytes of file ``file[i]``
    from offset ``start[i]``. Returns the pieces' (file, offset, length) columns, each range's
    pieces in offset order, the ranges in their given order, and how many pieces each range
    gave."""
    size = np.asarray(size, dtype=np.int64)
    count = np.where(size > 0, 1, 0)
    big = size > shard_size
    piece = np.where(big, size, shard_size).astype(np.int64)
    if big.any():
        split = size[big]
        parts = -(-split // shard_size)
        length = -(-split // parts)
        length = np.where(length >= align, -(-length // align) * align, length)
        piece[big] = length
        count[big] = -(-split // length)
    first = np.cumsum(count) - count  # where each range's first piece lands
    total = int(count.sum())
    index = np.arange(total, dtype=np.int64) - np.repeat(first, count)  # piece number within its range
    within = index * np.repeat(piece, count)
    lengths = np.minimum(np.repeat(piece, count), np.repeat(size, count) - within)
    files = np.repeat(np.asarray(file, dtype=np.int64), count)
    return files, np.repeat(np.asarray(start, dtype=np.int64), count) + within, lengths, count


# A vectorised LPT batch must place at least this many pieces to beat the heap; below it,
# the next stretch of pieces goes through the heap.
_BATCH_MIN = 64
_HEAP_STRETCH = 4096  # pieces at a time through the heap: bounds its Python loop between batches


def lpt_owners(lengths: np.ndarray, candidates: Sequence[int]) -> np.ndarray:
    """The classic LPT rule: ``lengths`` (in the order they are placed, largest first) each onto
    the least-loaded of ``candidates`` (ascending), ties to the lowest rank; each one's rank.

    Each rank is a plain integer key, ``load << shift | rank``: keys order as (load, rank)
    tuples do. With many ranks, the pieces go in batches (:func:`_lpt_batch`: as many as go,
    exactly as the heap would place them, to distinct ranks); where batches come out short,
    a stretch goes through a heap of keys (:func:`_lpt_heap`). Keys past int64 (loads of
    petabytes) take the heap of Python integers all the way.
    """
    chosen = np.empty(len(lengths), dtype=np.int64)
    if not len(lengths):
        return chosen
    shift = max(candidates[-1].bit_length(), 1)
    mask = (1 << shift) - 1
    if ((int(lengths.max()) * len(lengths)) << shift) + mask >= 1 << 63:
        heap = list(candidates)
        keys = _lpt_heap(heap, [n << shift for n in lengths.tolist()])
        return np.array([key & mask for key in keys], dtype=np.int64)
    steps = lengths << shift
    ranks = np.array(candidates, dtype=np.int64)  # the keys of zero loads, ascending
    done = 0
    while done < len(steps):
        if len(ranks) >= _BATCH_MIN:
            placed = _lpt_batch(ranks, steps[done : done + len(ranks)], chosen[done:])
            done += placed
            if placed >= _BATCH_MIN:
                continue
        stop = min(len(steps), done + _HEAP_STRETCH)
        heap = ranks.tolist()  # ascending: a heap already
        chosen[done:stop] = _lpt_heap(heap, steps[done:stop].tolist())
        ranks = np.sort(np.array(heap, dtype=np.int64))
        done = stop
    chosen &= mask
    return chosen


def _lpt_batch(keys: np.ndarray, steps: np.ndarray, out: np.ndarray) -> int:
    """Place the next pieces (``steps``: their lengths, shifted as the keys are) on ``keys``
    (ascending, updated in place) as the heap would, as long as each goes to a rank no
    earlier piece of the batch went to; their keys in ``out``. Returns how many (at least one).

    Piece ``j`` goes to the ``j``-th least key exactly when that key is below every key the
    pieces before it made (a rank they grew is then not the least yet).
    """
    count = len(steps)
    grown = keys[:count] + steps
    late = np.flatnonzero(keys[1:count] > np.minimum.accumulate(grown[: count - 1]))
    placed = int(late[0]) + 1 if len(late) else count
    out[:placed] = keys[:placed]
    keys[:placed] = grown[:placed]
    keys.sort()
    return placed


def _lpt_heap(heap: list[int], steps: list[int]) -> list[int]:
    """Place each of ``steps`` on the least key of ``heap`` (a heap, updated); the keys chosen."""
    chosen: list[int] = []
    record = chosen.append
    replace = heapq.heapreplace
    for step in steps:
        key = heap[0]
        record(key)
        replace(heap, key + step)  # one sift instead of a pop and a push
    return chosen


def largest_first(length: np.ndarray) -> np.ndarray:
    """The order of ``length``, largest first, ties in place (a stable sort of the negated lengths).

    As one unique integer key, ``(max - length) * n + position``, where it fits: any sort
    then gives the stable order, and the unstable one is the faster.
    """
    count = len(length)
    if not count or int(length.min()) < 0 or (int(length.max()) + 1) * count >= 1 << 62:
        stable: np.ndarray = np.argsort(-length, kind="stable")
        return stable
    key = (length.max() - length) * count + np.arange(count, dtype=np.int64)
    order: np.ndarray = np.argsort(key)
    return order


def make_plan(
    sizes: Sequence[int],
    files: Sequence[int] | np.ndarray,
    nranks: int,
    shard_size: int,
    owners: Sequence[int] | None = None,
    ranges: Sequence[tuple[int, int, int]] = (),
) -> Plan:
    """Assign every byte of ``files`` (indices into ``sizes``) to exactly one of ``owners``.

    ``owners`` defaults to every rank; it lets a later mode restrict downloads to a subset.
    ``ranges``: more bytes to place, ``(file, offset, length)`` each (what a resumed run
    still lacks of a file), split and placed like whole files; ``offset`` aligned.
    """
    if nranks <= 0:
        raise ValueError("nranks must be positive")
    candidates = sorted(set(owners)) if owners is not None else list(range(nranks))
    if not candidates or candidates[0] < 0 or candidates[-1] >= nranks:
        raise ValueError(f"owners must be a non-empty subset of 0..{nranks - 1}")
    # Every piece, column-wise: the files of one piece first, then those split, then what a
    # resumed run lacks (the order ties keep below).
    chosen = np.asarray(files, dtype=np.int64)
    lengths = np.asarray(sizes, dtype=np.int64)[chosen] if len(chosen) else np.zeros(0, dtype=np.int64)
    whole = (lengths > 0) & (lengths <= shard_size)
    big = lengths > shard_size
    more = np.array(ranges, dtype=np.int64).reshape(-1, 3)
    split = split_columns(
        np.concatenate((chosen[big], more[:, 0])),
        np.concatenate((np.zeros(int(big.sum()), dtype=np.int64), more[:, 1])),
        np.concatenate((lengths[big], more[:, 2])),
        shard_size,
    )
    file_of = np.concatenate((chosen[whole], split[0]))  # split[3]: each range's count, not needed
    offset_of = np.concatenate((np.zeros(int(whole.sum()), dtype=np.int64), split[1]))
    length_of = np.concatenate((lengths[whole], split[2]))
    # Where they are, (file, offset): the plan's order; and largest first, ties by place,
    # for the LPT (stable sorts, the same on every rank: every rank gets one plan).
    place = np.lexsort((offset_of, file_of))
    file_of, offset_of, length_of = file_of[place], offset_of[place], length_of[place]
    largest = largest_first(length_of)
    owner = np.empty(len(length_of), dtype=np.int64)
    owner[largest] = lpt_owners(length_of[largest], candidates)
    peer = np.zeros(len(length_of), dtype=np.bool_)
    return Plan.of_columns(ShardColumns(file_of, offset_of, length_of, owner, peer), nranks, copy=False)


def balanced_shard_size(plan: Plan, owners: int, shard_size: int) -> int | None:
    """A finer shard size for ``plan`` (made with ``shard_size`` over ``owners`` downloaders),
    or None: its largest share is within 1/BALANCE of the mean, or finer shards cannot help."""
    loads = plan.loads()
    total, largest = sum(loads), max(loads, default=0)
    if owners < 2 or total == 0 or largest * BALANCE <= (total / owners) * (BALANCE + 1):
        return None
    finer = max(BALANCED_MIN_SHARD, int(total / owners / BALANCE) // SHARD_ALIGN * SHARD_ALIGN)
    return finer if finer < shard_size and finer < int(plan.columns.length.max()) else None


def balanced_plan(
    sizes: Sequence[int],
    files: Sequence[int] | np.ndarray,
    nranks: int,
    shard_size: int,
    owners: Sequence[int] | None = None,
    ranges: Sequence[tuple[int, int, int]] = (),
) -> Plan:
    """:func:`make_plan`, with shards finer than ``shard_size`` where they share the download
    out more evenly (:func:`balanced_shard_size`): kept only if its largest share is smaller."""
    plan = make_plan(sizes, files, nranks, shard_size, owners, ranges)
    count = len(set(owners)) if owners is not None else nranks
    finer = balanced_shard_size(plan, count, shard_size)
    if finer is None:
        return plan
    other = make_plan(sizes, files, nranks, finer, owners, ranges)
    return other if max(other.loads()) < max(plan.loads()) else plan


def plan_transfers(
    sizes: Sequence[int],
    holders: Sequence[Sequence[int]],
    nranks: int,
    shard_size: int,
    owners: Sequence[int] | None = None,
    copies: int | None = None,
    partial: Mapping[int, Sequence[tuple[int, int, tuple[int, ...]]]] | None = None,
    receivers: Sequence[int] | None = None,
) -> Plan:
    """Plan every file that some copy lacks; ``holders[i]`` lists the ranks that have file ``i``.

    Peers before Azure: a file some ranks already have is broadcast from its lowest-rank
    holder and never downloaded; files no rank has are spread over ``owners`` by LPT;
    files held by ``copies`` ranks (default every rank: one copy per rank) are left out.

    ``partial`` (a resumed run): for a file some ranks hold only in part, its segments
    ``(offset, length, holders)`` (resume.segments; ``holders[i]`` is then not read). A
    segment nobody holds is placed by LPT with the whole files; one some hold is a peer
    shard of its lowest holder, sent only to the ``receivers`` (default every rank) that
    lack it; one every copy holds moves not at all.
    """
    needed = nranks if copies is None else copies
    partial = partial or {}
    # Who holds what, column-wise: most files are held by nobody (a first copy) or everybody.
    held = np.fromiter(map(len, holders), dtype=np.int64, count=len(holders)) > 0
    whole = np.ones(len(holders), dtype=np.bool_)
    whole[[i for i in partial if 0 <= i < len(holders)]] = False
    azure = np.flatnonzero(~held & whole)
    missing = [(i, off, length) for i, segs in partial.items() for off, length, by in segs if not by]
    plan = balanced_plan(sizes, azure, nranks, shard_size, owners, missing)
    # Peer pieces as (file, offset, size, owner), split below like the plan's.
    peer: list[_PeerPiece] = [
        (i, 0, sizes[i], min(holders[i]))
        for i in np.flatnonzero(held & whole).tolist()
        if len(set(holders[i])) < needed
    ]
    everyone = tuple(range(nranks)) if receivers is None else tuple(sorted(receivers))
    segments, to = _peer_segments(partial, needed, everyone, shard_size)
    peer += segments
    if not peer:  # a first copy: the plan's own shards, already in order
        return plan
    return _with_peer_shards(plan, peer, shard_size, nranks, to)


# A piece a peer sends, (file, offset, size, owner), and the receivers of peer shards by (file, offset).
_PeerPiece = tuple[int, int, int, int]
_ShardReceivers = dict[tuple[int, int], tuple[int, ...]]


def _peer_segments(
    partial: Mapping[int, Sequence[tuple[int, int, tuple[int, ...]]]], needed: int, everyone: tuple[int, ...], cut: int
) -> tuple[list[_PeerPiece], _ShardReceivers]:
    """The segments of ``partial`` some copies hold and fewer than ``needed`` do, as pieces sent
    by their lowest holder, and the receivers of each of their shards (of at most ``cut``
    bytes): those of ``everyone`` that lack the segment."""
    peer: list[_PeerPiece] = []
    to: _ShardReceivers = {}
    for i, segs in partial.items():
        for start, size, by in segs:
            if not by or len(set(by)) >= needed:
                continue  # nobody's (in the plan, from the source), or every copy's (moves not at all)
            lacking = tuple(r for r in everyone if r not in by)
            peer.append((i, start, size, min(by)))
            for offset, _ in split_ranges(size, cut):
                to[(i, start + offset)] = lacking
    return peer, to


def _with_peer_shards(plan: Plan, peer: list[_PeerPiece], shard_size: int, nranks: int, to: _ShardReceivers) -> Plan:
    """``plan`` and the ``peer`` pieces, cut into shards as its own are and sent to ``to``, in
    (file, offset) order."""
    ask = np.array(peer, dtype=np.int64).reshape(-1, 4)
    file_of, offset_of, length_of, count = split_columns(ask[:, 0], ask[:, 1], ask[:, 2], shard_size)
    owner_of = np.repeat(ask[:, 3], count)
    c = plan.columns
    merged = [np.concatenate(pair) for pair in zip(c[:4], (file_of, offset_of, length_of, owner_of), strict=True)]
    merged.append(np.concatenate((c.peer, np.ones(len(file_of), dtype=np.bool_))))
    # The plan's shards before the peers' where they tie (a stable sort, as before).
    order = np.lexsort((merged[1], merged[0]))
    return Plan.of_columns(ShardColumns(*(column[order] for column in merged)), nranks, to, copy=False)
