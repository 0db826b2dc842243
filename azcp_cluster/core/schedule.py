"""The transfer schedule: which bytes go from which node to which, in which order and slot. Pure code.

The schedule is data, derived identically on every rank from the plan, so the fan-out
engine (:mod:`azcp_cluster.core.fanout` decides, :mod:`azcp_cluster.fanout.broadcast` drives) only
walks a list. A *transfer* is one slot's worth of bytes: a sequence number, the rank of the
broadcast communicator that sends it (its *root*), the ranks that receive it, and its
*extents*, each a byte range of one file and its place in the slot. A fan-out mode (one
reader, several readers, a replica or scatter mode) is a different list of transfers, not
a different engine.

* **Packing.** Consecutive pieces from one root with the same receivers share a slot: a
  tree of small files travels in a few large messages, not one message per file.
* **Alignment.** An extent of at least :data:`DIRECT_MIN` bytes that starts on an aligned
  file offset is placed on an aligned offset of the slot, so it can be written (and read
  back by its root) with O_DIRECT; shorter extents are packed tightly and written buffered.
* **Order.** Transfers are ordered by when their bytes are expected on their root's node
  (each root's share is downloaded in schedule order, at about the same rate as the other
  roots'), so a streaming fan-out never waits for one root while another's bytes sit idle.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from azcp_cluster.core.plan import SHARD_ALIGN, Plan

# MPI counts are C ints; the reference tool splits each call at 1 GiB to stay well below.
MAX_CALL_BYTES = 1 << 30
# Extents at least this long keep O_DIRECT alignment in the slot; shorter ones are packed
# tightly and written through the page cache (for a 10 KiB file, two descriptors and an
# aligned head plus a buffered tail cost more than one buffered write).
DIRECT_MIN = 64 * 1024
# At most this many extents share a slot: the writes of one slot are spread over the writer
# threads, and a slot comes back (for the next read) after its last extent is written.
MAX_EXTENTS = 1024
ALIGN = SHARD_ALIGN


class Extent(NamedTuple):
    """``length`` bytes of file ``file`` at ``offset``, carried at ``at`` in its transfer's slot.

    A named tuple for the cost of making a million (see plan.Shard).
    """

    file: int
    offset: int
    length: int
    at: int
    last_of_file: bool  # no later extent of this file comes from this root: the root may close it

    @property
    def direct(self) -> bool:
        """Whether the extent may be written (and read) with O_DIRECT: long and aligned on both sides."""
        return self.length >= DIRECT_MIN and self.at % ALIGN == 0 and self.offset % ALIGN == 0


class Transfer(NamedTuple):
    """One slot's worth of bytes, sent by ``root`` to ``receivers`` (ranks of the broadcast communicator).

    A named tuple for the cost of making a million (a frozen dataclass took 1.5 us each).
    """

    seq: int  # position in the schedule
    root: int
    receivers: tuple[int, ...]  # ascending, never the root
    extents: tuple[Extent, ...]
    everyone: bool  # every other rank receives it: one collective broadcast

    @property
    def length(self) -> int:
        """Bytes on the wire: up to the end of the last extent in the slot."""
        return max(e.at + e.length for e in self.extents)

    def involves(self, rank: int) -> bool:
        """Whether ``rank`` takes part (sends or receives)."""
        return rank == self.root or rank in self.receivers


Receivers = Callable[[int, int], tuple[int, ...]]  # (file, root) -> the ranks that receive it


class ExtentColumns(NamedTuple):
    """Extents as columns (numpy arrays, one entry an extent; integers int32 where they fit)."""

    file: np.ndarray
    offset: np.ndarray  # int64
    length: np.ndarray
    at: np.ndarray
    last_of_file: np.ndarray  # bool


class Transfers(Sequence[Transfer]):
    """A schedule: its transfers in order, held as columns; each :class:`Transfer` is made when asked for.

    A million transfers as tuples (with their extents) cost some 700 MB and seconds to make;
    as columns 16 bytes a transfer and 21 an extent (int32 where it holds them).
    ``schedule[seq]``, a slice and iteration give the same :class:`Transfer` tuples a list
    would (equal, not always identical); the functions below (:func:`files_written`,
    :func:`completions`, :func:`streamed_files`, :class:`Landing`, :func:`involving`) read the
    columns. Immutable.

    ``schedule[seq]`` makes the next :data:`_NEAR` transfers with it and keeps the last few
    thousand made so: the fan-out asks for each transfer several times (to read it, post it,
    and to look ahead), in schedule order.
    """

    __slots__ = ("_bounds", "_everyone", "_group", "_near", "_receivers", "_root", "extents", "ranks")

    def __init__(
        self,
        root: np.ndarray,
        group: np.ndarray,
        receivers: Sequence[tuple[int, ...]],
        bounds: np.ndarray,
        extents: ExtentColumns,
        ranks: int,
    ) -> None:
        """``root[t]``, ``receivers[group[t]]`` and the extents ``bounds[t]:bounds[t + 1]`` of
        transfer ``t`` (``bounds`` one longer than ``root``), over ``ranks`` ranks. Integer
        columns of any width (the narrowest that holds them saves memory)."""
        self._root = _read_only(np.asarray(root))
        self._group = _read_only(np.asarray(group))
        self._receivers = tuple(receivers)
        self._everyone = tuple(len(to) == ranks - 1 for to in self._receivers)
        self._bounds = _read_only(np.asarray(bounds, dtype=np.int64))
        self.extents = ExtentColumns(*(_read_only(np.asarray(column)) for column in extents))
        self.ranks = ranks
        self._near: dict[int, Transfer] = {}
        if len(self._bounds) != len(self._root) + 1 or len(self._group) != len(self._root):
            raise ValueError("transfer columns of different lengths")

    @classmethod
    def of(cls, transfers: Sequence[Transfer], ranks: int) -> Transfers:
        """The columns of a list of transfers (their ``seq`` must be their position)."""
        if any(t.seq != i for i, t in enumerate(transfers)):
            raise ValueError("a transfer's seq must be its position")
        numbers: dict[tuple[int, ...], int] = {}
        group = [numbers.setdefault(tuple(t.receivers), len(numbers)) for t in transfers]
        rows = [e for t in transfers for e in t.extents]
        file, offset, length, at = (np.array([e[i] for e in rows], dtype=np.int64) for i in range(4))
        last = np.array([e.last_of_file for e in rows], dtype=np.bool_)
        bounds = np.cumsum([0] + [len(t.extents) for t in transfers])
        root = np.array([t.root for t in transfers], dtype=np.int64)
        return cls(
            root,
            np.array(group, dtype=np.int64),
            list(numbers),
            bounds,
            ExtentColumns(file, offset, length, at, last),
            ranks,
        )

    def __len__(self) -> int:
        return len(self._root)

    def __getitem__(self, index: int | slice) -> Transfer | list[Transfer]:  # type: ignore[override]
        if isinstance(index, slice):
            seqs = range(*index.indices(len(self)))
            if len(seqs) <= _NEAR:  # a look ahead: from the transfers made near it
                return [self._near_one(seq) for seq in seqs]
            return self.select(seqs)
        count = len(self._root)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError("transfer index out of range")
        return self._near_one(index)

    def _near_one(self, index: int) -> Transfer:
        """Transfer ``index`` (in range), from those made near it (see the class)."""
        count = len(self._root)
        near = self._near
        transfer = near.get(index)
        if transfer is None:
            if len(near) >= _NEAR_KEPT:
                near = self._near = {}  # a new dict: a thread reading the old one still finds its own
            made = self.select(range(index, min(count, index + _NEAR)))
            near.update(zip(range(index, index + len(made)), made, strict=True))
            transfer = made[0]
        return transfer

    def __iter__(self) -> Iterator[Transfer]:
        for start in range(0, len(self), _BATCH):
            yield from self.select(range(start, min(start + _BATCH, len(self))))

    def select(self, seqs: Sequence[int] | np.ndarray) -> list[Transfer]:
        """The transfers of these sequence numbers, in their order (made in one go)."""
        seqs = np.asarray(seqs, dtype=np.int64).reshape(-1)
        if not len(seqs):
            return []
        first, end = self._bounds[seqs], self._bounds[seqs + 1]
        counts = end - first
        places = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
        e = self.extents
        rows = (e.file[places], e.offset[places], e.length[places], e.at[places], e.last_of_file[places])
        made = list(map(Extent._make, zip(*(c.tolist() for c in rows), strict=True)))
        cuts = np.cumsum(counts).tolist()
        receivers, everyone = self._receivers, self._everyone
        groups = self._group[seqs].tolist()
        return [
            Transfer(seq, root, receivers[g], tuple(made[b - n : b]), everyone[g])
            for seq, root, g, b, n in zip(
                seqs.tolist(), self._root[seqs].tolist(), groups, cuts, counts.tolist(), strict=True
            )
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Transfers(<{len(self)} transfers, {len(self.extents.file)} extents>)"

    @property
    def roots(self) -> np.ndarray:
        """Each transfer's root."""
        return self._root

    @property
    def counts(self) -> np.ndarray:
        """How many extents each transfer has."""
        counts: np.ndarray = np.diff(self._bounds)
        return counts

    @property
    def lengths(self) -> np.ndarray:
        """Each transfer's bytes on the wire: the end of its last extent (the slot fills in order)."""
        last = self._bounds[1:] - 1
        lengths: np.ndarray = self.extents.at[last] + self.extents.length[last]
        return lengths

    def involving(self, rank: int) -> np.ndarray:
        """The transfers ``rank`` sends or receives, as an ascending array of sequence numbers."""
        receives = np.array([rank in to for to in self._receivers], dtype=np.bool_)
        chosen = (self._root == rank) | (receives[self._group] if len(receives) else False)
        seqs: np.ndarray = np.flatnonzero(chosen)
        return seqs

    def per_extent(self, column: np.ndarray) -> np.ndarray:
        """A per-transfer column repeated for each of the transfer's extents."""
        repeated: np.ndarray = np.repeat(column, self.counts)
        return repeated


_BATCH = 4096  # transfers made at once when iterating
_NEAR = 64  # transfers made at once by schedule[seq]
_NEAR_KEPT = 4096  # the most kept


def _read_only(array: np.ndarray) -> np.ndarray:
    """``array`` made read-only: itself when it owns its data, else a copy (never a view of
    something that may change)."""
    if array.base is None:
        array.flags.writeable = False
        return array
    copy: np.ndarray = array.copy()
    copy.flags.writeable = False
    return copy


def as_transfers(schedule: Sequence[Transfer], ranks: int | None = None) -> Transfers:
    """``schedule`` as :class:`Transfers` (itself if it is one; ``ranks`` for a list, default
    one more than the highest rank in it)."""
    if isinstance(schedule, Transfers):
        return schedule
    if ranks is None:
        ranks = 1 + max((max(t.root, *t.receivers) for t in schedule), default=0)
    return Transfers.of(schedule, ranks)


def involving(schedule: Sequence[Transfer], rank: int) -> np.ndarray:
    """The sequence numbers of the transfers ``rank`` sends or receives, ascending (an array)."""
    if isinstance(schedule, Transfers):
        return schedule.involving(rank)
    return np.array([t.seq for t in schedule if t.involves(rank)], dtype=np.int64)


def rooted_at(schedule: Sequence[Transfer], root: int) -> Iterator[Transfer]:
    """The transfers ``root`` sends, in schedule order (from columns, made a batch at a time)."""
    if not isinstance(schedule, Transfers):
        yield from (t for t in schedule if t.root == root)
        return
    seqs = np.flatnonzero(schedule.roots == root)
    for start in range(0, len(seqs), _BATCH):
        yield from schedule.select(seqs[start : start + _BATCH])


def transfers_at(schedule: Sequence[Transfer], seqs: Sequence[int] | np.ndarray) -> list[Transfer]:
    """The transfers of these sequence numbers (made in one go from columns)."""
    if isinstance(schedule, Transfers):
        return schedule.select(seqs)
    return [schedule[seq] for seq in np.asarray(seqs, dtype=np.int64).tolist()]


def max_length(schedule: Sequence[Transfer]) -> int:
    """The largest transfer's bytes on the wire (0 for none)."""
    if isinstance(schedule, Transfers):
        return int(schedule.lengths.max()) if len(schedule) else 0
    return max((t.length for t in schedule), default=0)


def payload(schedule: Sequence[Transfer]) -> int:
    """Bytes of file data in the transfers (not the alignment padding)."""
    if isinstance(schedule, Transfers):
        return int(schedule.extents.length.sum(dtype=np.int64))
    return sum(e.length for t in schedule for e in t.extents)


def files_of(schedule: Sequence[Transfer]) -> int:
    """How many files have bytes in the transfers."""
    if isinstance(schedule, Transfers):
        return len(np.unique(schedule.extents.file))
    return len({e.file for t in schedule for e in t.extents})


class _Receivers:
    """The receivers of each shard as small integers: equal tuples, one number (the packing
    compares numbers, not tuples of a thousand ranks)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.tuples: list[tuple[int, ...]] = []
        self.numbers: dict[tuple[int, ...], int] = {}

    def number(self, to: tuple[int, ...]) -> int:
        """The number of ``to`` (the first of its value to come keeps its object)."""
        found = self.numbers.get(to)
        if found is None:
            found = self.numbers[to] = len(self.tuples)
            self.tuples.append(to)
        return found

    def everyone_but(self, roots: np.ndarray) -> np.ndarray:
        """The number of "every rank but the root" for each of ``roots``."""
        present = np.flatnonzero(np.bincount(roots)).tolist()
        numbers = np.zeros(max(present) + 1 if present else 0, dtype=np.int64)
        ranks = list(range(self.ranks))  # one int object per rank, shared by the tuples
        for root in present:
            numbers[root] = self.number(tuple(ranks[:root] + ranks[root + 1 :]))
        chosen: np.ndarray = numbers[roots]
        return chosen


def _receivers(
    plan: Plan,
    file: np.ndarray,
    offset: np.ndarray,
    root: np.ndarray,
    ranks: int,
    root_of: Sequence[int] | None,
    receivers_of: Receivers | None,
) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """Each shard's receivers, numbered (see :class:`_Receivers`), and the tuples by number."""
    numbered = _Receivers(ranks)
    named = plan.receivers
    if receivers_of is None:
        group = numbered.everyone_but(root)  # one object per root, sorted, without the root
    else:
        lists = (file.tolist(), root.tolist())
        group = np.array(
            [numbered.number(tuple(sorted(set(receivers_of(f, r)) - {r}))) for f, r in zip(*lists, strict=True)],
            dtype=np.int64,
        ).reshape(-1)
    if named:  # a resumed run: the ranges some copies kept go only to the copies that lack them
        files = np.fromiter({f for f, _ in named}, dtype=np.int64)
        for k in np.flatnonzero(np.isin(file, files)).tolist():
            to = named.get((int(file[k]), int(offset[k])))
            if to is not None:
                r = int(root[k])
                group[k] = numbered.number(tuple(sorted({t if root_of is None else root_of[t] for t in to} - {r})))
    return group, numbered.tuples


_CHUNK = 1 << 16  # pieces packed per batch of Python lists (their memory stays small)


def _pack(length: np.ndarray, direct: np.ndarray, forced: np.ndarray, slot_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which pieces open a transfer, and where in its slot each piece goes: a piece joins its
    root's open transfer if it fits (aligned when ``direct``, else tight) and the transfer
    holds fewer than MAX_EXTENTS, else it opens the next one.

    ``forced``: the pieces known to open one (a root's first, new receivers, no packing, or
    with the piece before more than a slot); the loop visits only the others, a batch of
    plain lists at a time.
    """
    at = np.zeros(len(length), dtype=length.dtype)  # within a slot: as narrow as the lengths
    visit = np.flatnonzero(~forced)
    up, down = ALIGN - 1, -ALIGN  # ALIGN is a power of two
    used = count = 0
    for start in range(0, len(visit), _CHUNK):
        chunk = visit[start : start + _CHUNK]
        # A visited piece right after a forced one finds a transfer holding just that one:
        # ``previous`` is that one's length (never 0), else 0.
        previous = np.where(forced[chunk - 1], length[chunk - 1], 0)
        places: list[int] = []
        placed = places.append
        for size, before, aligned in zip(
            length[chunk].tolist(), previous.tolist(), direct[chunk].tolist(), strict=True
        ):
            if before:
                used, count = before, 1
            place = (used + up) & down if aligned else used
            if place + size > slot_size or count >= MAX_EXTENTS:
                place = count = 0
            placed(place)
            used = place + size
            count += 1
        at[chunk] = places
    # A visited piece that joins a transfer lies after that one's first bytes: at 0, it opens one.
    opens = forced | (at == 0)
    return opens, at


class _Pieces(NamedTuple):
    """The plan's shards cut into slot-sized pieces, each root's in plan order, root after root."""

    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    root: np.ndarray
    group: np.ndarray  # the receivers' number
    last: np.ndarray  # the last extent of its file from its root


def _narrow(array: np.ndarray, most: int | None = None) -> np.ndarray:
    """``array`` (integers from 0 up to ``most``, default its largest) as int32 where they fit."""
    top = int(array.max()) if most is None and len(array) else (most or 0)
    if top < 1 << 31 and (not len(array) or int(array.min()) >= -(1 << 31)):
        narrow: np.ndarray = array.astype(np.int32)
        return narrow
    return array


def _pieces(
    file: np.ndarray, offset: np.ndarray, length: np.ndarray, root: np.ndarray, group: np.ndarray, slot_size: int
) -> _Pieces:
    """The shards (of positive length, in plan order) grouped by root, and cut into pieces of
    at most ``slot_size``: a root's packing and landing order depend on its own pieces only.
    The columns that fit are int32 (millions of pieces: a third less memory)."""
    root, group, file = _narrow(root), _narrow(group), _narrow(file)
    by_root = np.argsort(root.astype(np.int16) if len(root) and root.max() < 1 << 15 else root, kind="stable")
    file, offset, length, root, group = file[by_root], offset[by_root], length[by_root], root[by_root], group[by_root]
    del by_root
    # A shard's last extent is its file's last from this root unless the root's next shard
    # is of the same file.
    last = np.ones(len(file), dtype=np.bool_)
    last[:-1] = (root[1:] != root[:-1]) | (file[1:] != file[:-1])
    count = -(-length // slot_size)
    if int(count.max()) == 1:
        return _Pieces(file, offset, _narrow(length, slot_size), root, group, last)
    end = np.repeat(offset + length, count)
    first = np.cumsum(count) - count
    offset = np.repeat(offset, count) + (np.arange(len(end), dtype=np.int64) - np.repeat(first, count)) * slot_size
    del first
    length = np.minimum(slot_size, end - offset)
    last = np.repeat(last, count) & (offset + length == end)
    del end
    length = _narrow(length, slot_size)
    return _Pieces(np.repeat(file, count), offset, length, np.repeat(root, count), np.repeat(group, count), last)


def transfer_schedule(
    plan: Plan,
    slot_size: int,
    ranks: int,
    *,
    root_of: Sequence[int] | None = None,
    receivers_of: Receivers | None = None,
    pack: bool = True,
) -> Transfers:
    """Cut ``plan`` into transfers of at most ``slot_size`` bytes, packed and ordered (see the module).

    ``ranks`` is the size of the broadcast communicator. A piece's root is its shard's
    owner, or ``root_of[owner]`` when the broadcast runs on a smaller communicator than the
    plan (between node leaders: the owner's leader sends). ``receivers_of(file, root)``
    names the ranks that get a file; by default every rank but the root (a full copy on
    every node). A shard the plan names receivers for (``Plan.receivers``: a range some
    copies kept from a stopped run) goes to those only. ``pack=False`` gives every piece
    its own transfer.

    Column-wise: the pieces, their roots and receivers are numpy columns; one loop of plain
    integers packs the pieces that may share a slot (:func:`_pack`); the schedule stays
    columns (:class:`Transfers`), its transfers made as they are read.
    """
    if slot_size <= 0:
        raise ValueError("slot_size must be positive")
    c = plan.columns
    roots = c.owner if root_of is None else np.asarray(root_of, dtype=np.int64).reshape(-1)[c.owner]
    loads = _sums(roots, c.length)
    kept = c.length > 0  # no bytes, no extent (and the file's last extent stays its last)
    if not kept.any():
        return Transfers.of([], ranks)
    file, offset, root = c.file[kept], c.offset[kept], roots[kept]
    group, tuples = _receivers(plan, file, offset, root, ranks, root_of, receivers_of)
    p = _pieces(file, offset, c.length[kept], root, group, slot_size)
    del file, offset, root, group, kept, roots
    # Pieces that open a transfer whatever came before: a root's first, new receivers, no
    # packing, or a piece that cannot share a slot with the one before (that one is at its
    # slot's offset 0 or later).
    forced = np.ones(len(p.length), dtype=np.bool_)
    if pack:
        forced[1:] = (p.root[1:] != p.root[:-1]) | (p.group[1:] != p.group[:-1])
        forced[1:] |= p.length[1:] > slot_size - p.length[:-1]  # (no sum: it could overflow int32)
    direct = (p.length >= DIRECT_MIN) & ((p.offset & (ALIGN - 1)) == 0)  # aligned in the slot if it can be
    opens, at = _pack(p.length, direct, forced, slot_size)
    del forced, direct
    starts = np.flatnonzero(opens)
    del opens
    order, counts = _landing_order(p, starts, loads)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    # The extents in schedule order: each transfer's run of pieces, the transfers in order.
    places = np.repeat(starts[order] - bounds[:-1], counts) + np.arange(len(p.length), dtype=np.int64)
    t_root, t_group = p.root[starts][order], p.group[starts][order]
    del starts, order, counts
    columns = [p.file, p.offset, p.length, at, p.last]
    del p, at
    for i, column in enumerate(columns):  # one at a time: each piece column freed as it is replaced
        columns[i] = column[places]
        del column
    return Transfers(t_root, t_group, tuples, bounds, ExtentColumns(*columns), ranks)


def _landing_order(p: _Pieces, starts: np.ndarray, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The transfers (opened at ``starts``) by expected landing: the share of its root's bytes
    (``loads``) landed at each one's end, ties by root; a root's transfers keep their order
    (their keys only grow, and the sort is stable). Returns the order and each one's count of
    extents, in that order."""
    last = np.append(starts[1:], len(p.length)) - 1  # each transfer's last piece
    landed = np.cumsum(p.length, dtype=np.int64)
    root_first = np.flatnonzero(np.append(True, p.root[1:] != p.root[:-1]))
    before = landed[root_first] - p.length[root_first]  # the bytes of the roots before each root
    t_root = p.root[starts]
    # Each transfer's root's place among the roots (roots come one after another, ascending).
    landed = landed[last] - before[np.searchsorted(root_first, starts, side="right") - 1]
    key = _landing_keys(landed, loads[t_root])
    del landed, t_root
    # Ties by root, then by position: the pieces come root after root, ascending.
    order = np.argsort(key, kind="stable")
    counts: np.ndarray = (last + 1 - starts)[order]
    return order, counts


def _sums(index: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` summed by ``index`` (non-negative integers), exactly."""
    if not len(index):
        return np.zeros(0, dtype=np.int64)
    if int(np.abs(values).max()) * len(values) < 1 << 53:  # float sums of integers are exact below 2**53
        return np.bincount(index, weights=values).astype(np.int64)
    sums = np.zeros(int(index.max()) + 1, dtype=np.int64)
    np.add.at(sums, index, values)
    return sums


def _landing_keys(landed: np.ndarray, total: np.ndarray) -> np.ndarray:
    """``landed / total`` as Python divides integers (correctly rounded; 0.0 where ``total`` is 0)."""
    if len(total) and int(np.abs(total).max()) < 1 << 53 and int(np.abs(landed).max()) < 1 << 53:
        # Both exact in a double: the IEEE quotient is Python's correctly rounded one.
        with np.errstate(divide="ignore", invalid="ignore"):
            key = landed.astype(np.float64) / total.astype(np.float64)
        return np.where(total != 0, key, 0.0)
    pairs = zip(landed.tolist(), total.tolist(), strict=True)
    return np.array([a / b if b else 0.0 for a, b in pairs], dtype=np.float64)


def files_written(schedule: Sequence[Transfer], rank: int) -> set[int]:
    """The files with some extent that ``rank`` sends or receives: the files its node writes
    (a root writes what its node downloaded, or its own copy of what it reads from a source),
    unless the node already has them."""
    if isinstance(schedule, Transfers):
        mine = np.zeros(len(schedule), dtype=np.bool_)
        mine[schedule.involving(rank)] = True
        files: set[int] = set(np.unique(schedule.extents.file[schedule.per_extent(mine)]).tolist())
        return files
    return {e.file for t in schedule if t.involves(rank) for e in t.extents}


def completions(schedule: Sequence[Transfer]) -> list[int]:
    """Per transfer, how many files it completes (their last extent in schedule order is in it)."""
    if isinstance(schedule, Transfers):
        file = schedule.extents.file
        # Each file's last extent: the first in the reversed order.
        _, from_end = np.unique(file[::-1], return_index=True)
        seq_of = schedule.per_extent(np.arange(len(schedule), dtype=np.int64))
        done: list[int] = np.bincount(seq_of[len(file) - 1 - from_end], minlength=len(schedule)).tolist()
        return done
    last: dict[int, int] = {}
    for transfer in schedule:
        for extent in transfer.extents:
            last[extent.file] = transfer.seq
    counts = [0] * len(schedule)
    for seq in last.values():
        counts[seq] += 1
    return counts


def streamed_files(schedule: Sequence[Transfer], rank: int, sizes: Sequence[int]) -> set[int]:
    """The files whose every byte passes ``rank``'s slots in offset order (hashable in flight, for --verify stream)."""
    if isinstance(schedule, Transfers):
        return _streamed_columns(schedule, rank, sizes)
    position: dict[int, int] = {}
    broken: set[int] = set()
    for transfer in schedule:
        seen = transfer.involves(rank)
        for extent in transfer.extents:
            if not seen or position.get(extent.file, 0) != extent.offset:
                broken.add(extent.file)
            position[extent.file] = extent.offset + extent.length
    return {f for f, end in position.items() if f not in broken and end == sizes[f]}


def _streamed_columns(schedule: Transfers, rank: int, sizes: Sequence[int]) -> set[int]:
    """:func:`streamed_files` on columns: each file's extents in schedule order, all seen by
    ``rank``, each starting where the one before ended (the first at 0), the last at its size."""
    e = schedule.extents
    if not len(e.file):
        return set()
    mine = np.zeros(len(schedule), dtype=np.bool_)
    mine[schedule.involving(rank)] = True
    seen = schedule.per_extent(mine)
    order = np.argsort(e.file, kind="stable")  # by file, schedule order within each
    file, offset, end, seen = e.file[order], e.offset[order], (e.offset + e.length)[order], seen[order]
    first = np.append(True, file[1:] != file[:-1])
    follows = np.ones(len(file), dtype=np.bool_)
    follows[1:] = offset[1:] == end[:-1]
    good = seen & np.where(first, offset == 0, follows)
    starts = np.flatnonzero(first)
    whole = np.logical_and.reduceat(good, starts)
    lasts = np.append(starts[1:], len(file)) - 1
    candidates = file[starts][whole]
    ends = end[lasts][whole]
    size = np.asarray(sizes, dtype=np.int64)[candidates] if len(candidates) else ends
    streamed: set[int] = set(candidates[ends == size].tolist())
    return streamed


class Landing:
    """When a streaming root may send: which downloaded blocks each of its transfers waits for. Pure.

    ``blocks`` are the ranged GETs of one node's downloaders, ``(file, offset, length)``.
    A transfer rooted on the node waits for every block that overlaps one of its extents;
    it is ready when the last has landed (its bytes are on the node's disk).
    """

    def __init__(self, schedule: Sequence[Transfer], root: int, blocks: Sequence[tuple[int, int, int]]) -> None:
        by_file: dict[int, list[tuple[int, int, int]]] = {}  # file -> [(offset, end, block index)]
        for index, (file, offset, length) in enumerate(blocks):
            by_file.setdefault(file, []).append((offset, offset + length, index))
        for spans in by_file.values():
            spans.sort()
        starts = {file: [s[0] for s in spans] for file, spans in by_file.items()}
        self.waits: dict[int, int] = {}  # seq -> blocks still to land
        self.feeds: list[list[int]] = [[] for _ in blocks]  # block index -> seqs it completes part of
        for transfer in rooted_at(schedule, root):
            needed: set[int] = set()
            for extent in transfer.extents:
                spans = by_file.get(extent.file, [])
                end = extent.offset + extent.length
                # The block that holds the extent's first byte, and the ones after it up to its end.
                i = max(0, bisect.bisect_right(starts.get(extent.file, []), extent.offset) - 1)
                while i < len(spans) and spans[i][0] < end:
                    if spans[i][1] > extent.offset:
                        needed.add(spans[i][2])
                    i += 1
            self.waits[transfer.seq] = len(needed)
            for index in needed:
                self.feeds[index].append(transfer.seq)

    def ready(self) -> list[int]:
        """The transfers (seqs) that wait for no block at all."""
        return sorted(seq for seq, n in self.waits.items() if n == 0)

    def landed(self, block: int) -> list[int]:
        """Block ``block`` is on the disk: the transfers that are now ready."""
        now = []
        for seq in self.feeds[block]:
            self.waits[seq] -= 1
            if self.waits[seq] == 0:
                now.append(seq)
        self.feeds[block] = []
        return now

    def order(self) -> list[int]:
        """Block indices in the order the schedule needs them (download them in this order)."""
        first = [min(seqs) if seqs else -1 for seqs in self.feeds]
        return sorted(range(len(self.feeds)), key=lambda i: (first[i], i))


def call_slices(length: int, limit: int = MAX_CALL_BYTES) -> Iterator[tuple[int, int]]:
    """Split one transfer into ``(start, stop)`` slices of at most ``limit`` bytes for MPI calls."""
    if limit <= 0:
        raise ValueError("limit must be positive")
    start = 0
    while start < length:
        stop = min(length, start + limit)
        yield start, stop
        start = stop
