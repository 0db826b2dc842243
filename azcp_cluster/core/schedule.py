"""The transfer schedule: which bytes go from which node to which, in which order and slot. Pure code.

The schedule is data, derived identically on every rank from the plan, so the fan-out
engine (:mod:`azcp_cluster.core.fanout` decides, :mod:`azcp_cluster.fanout.driver` drives) only
walks a list. A *transfer* is one slot's worth of bytes: a sequence number, the rank of the
broadcast communicator that sends it (its *root*), the ranks that receive it, and its
*extents*, each a byte range of one file and its place in the slot. A fan-out mode (one
reader, several readers, a replica or scatter mode) is a different list of transfers, not
a different engine.

This module holds the schedule as data (:class:`Transfer`, :class:`Transfers`: columns
made into transfers as they are read) and what the engine asks of it (who writes which
file, which files stream, which downloaded blocks a transfer waits for: :class:`Landing`).
Making it from the plan (packing, alignment, order) is
:func:`azcp_cluster.core.packing.transfer_schedule`'s.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from azcp_cluster.core.columns import distinct
from azcp_cluster.core.plan import SHARD_ALIGN

# MPI counts are C ints; the reference tool splits each call at 1 GiB to stay well below.
MAX_CALL_BYTES = 1 << 30
# Extents at least this long keep O_DIRECT alignment in the slot; shorter ones are packed
# tightly and written through the page cache (for a 10 KiB file, two descriptors and an
# aligned head plus a buffered tail cost more than one buffered write).
DIRECT_MIN = 64 * 1024
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
        return len(distinct(schedule.extents.file))
    return len({e.file for t in schedule for e in t.extents})


def files_written(schedule: Sequence[Transfer], rank: int) -> set[int]:
    """The files with some extent that ``rank`` sends or receives: the files its node writes
    (a root writes what its node downloaded, or its own copy of what it reads from a source),
    unless the node already has them."""
    if isinstance(schedule, Transfers):
        mine = np.zeros(len(schedule), dtype=np.bool_)
        mine[schedule.involving(rank)] = True
        files: set[int] = set(distinct(schedule.extents.file[schedule.per_extent(mine)]).tolist())
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
