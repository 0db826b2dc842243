"""Building the transfer schedule from the plan: pieces, receivers, packing into slots, landing order. Pure code.

Apart from the schedule as data (schedule.py: :class:`~azcp_cluster.core.schedule.Transfers`
and what the fan-out engine asks of it) because this is the one computation that makes it,
column-wise over millions of pieces, and nothing that reads a schedule needs it.

* **Packing.** Consecutive pieces from one root with the same receivers share a slot: a
  tree of small files travels in a few large messages, not one message per file.
* **Alignment.** An extent of at least :data:`~azcp_cluster.core.schedule.DIRECT_MIN` bytes
  that starts on an aligned file offset is placed on an aligned offset of the slot, so it
  can be written (and read back by its root) with O_DIRECT; shorter extents are packed
  tightly and written buffered.
* **Order.** Transfers are ordered by when their bytes are expected on their root's node
  (each root's share is downloaded in schedule order, at about the same rate as the other
  roots'), so a streaming fan-out never waits for one root while another's bytes sit idle.
* **Many roots.** Bytes spread over several nodes go round a ring only while every root has
  transfers in flight: :func:`spread_chunk` cuts them small enough for that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from azcp_cluster.core.plan import Plan
from azcp_cluster.core.schedule import ALIGN, DIRECT_MIN, ExtentColumns, Transfers

# A copy that does not stream, its bytes on several nodes (the download over, or
# --source-readers): the fan-out's slots hold this many transfers of every root at once, so
# that every root's link carries some, not half the roots at a time waiting for the slowest
# (docs/benchmarks.md).
RING_DEPTH = 2
# ...but no smaller than this (a message, an agreement every 16, a write per transfer).
MIN_SPREAD_CHUNK = 1 << 20

# At most this many extents share a slot: the writes of one slot are spread over the writer
# threads, and a slot comes back (for the next read) after its last extent is written.
MAX_EXTENTS = 1024

Receivers = Callable[[int, int], tuple[int, ...]]  # (file, root) -> the ranks that receive it


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


def halves(length: int, smallest: int) -> list[int]:
    """``length`` cut into halves of what is left (L/2, L/4, …, multiples of ``smallest``) down
    to ``smallest``, then the rest: what lands last of a streamed share, and must still be sent
    after the download is over, is small (``core.blocks.taper`` cuts a last block so too)."""
    out: list[int] = []
    left = length
    while left > smallest:
        piece = (left // 2) // smallest * smallest
        if piece < smallest:
            break
        out.append(piece)
        left -= piece
    out.append(left)
    return out


def _taper(p: _Pieces, smallest: int) -> tuple[_Pieces, np.ndarray]:
    """Each root's last piece cut by :func:`halves`, and which pieces must open a transfer of
    their own (those cut: packing would put them back together)."""
    ends = np.flatnonzero(np.append(p.root[1:] != p.root[:-1], True)) if len(p.root) else np.zeros(0, np.int64)
    cuts = {int(i): cut for i in ends.tolist() if len(cut := halves(int(p.length[i]), smallest)) > 1}
    if not cuts:
        return p, np.zeros(len(p.length), dtype=np.bool_)
    count = np.ones(len(p.length), dtype=np.int64)
    for i, lengths in cuts.items():
        count[i] = len(lengths)
    first = np.cumsum(count) - count  # each old piece's first place among the new
    offset = np.repeat(p.offset.astype(np.int64), count)
    length = np.repeat(p.length.astype(np.int64), count)
    last = np.repeat(p.last, count)
    own = np.zeros(len(length), dtype=np.bool_)
    for i, lengths in cuts.items():
        at = int(first[i])
        steps = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
        offset[at : at + len(lengths)] = int(p.offset[i]) + steps
        length[at : at + len(lengths)] = lengths
        last[at : at + len(lengths) - 1] = False  # the file's last extent is the last cut, if any
        own[at : at + len(lengths)] = True
    pieces = _Pieces(
        np.repeat(p.file, count),
        offset,
        _narrow(length, int(length.max())),
        np.repeat(p.root, count),
        np.repeat(p.group, count),
        last,
    )
    return pieces, own


def spread_chunk(chunk: int, pipeline: int, roots: int, most_slots: int) -> int:
    """The transfer size of a copy that does not stream whose bytes are on ``roots`` nodes: at
    most ``chunk`` (``--bcast-chunk``), and, with several roots, the largest power of two that
    lets the fan-out's memory (``pipeline`` slots of ``chunk`` bytes, cut into slots of the
    transfer size: ``blocks.fanout_slots``, at most ``most_slots``) hold RING_DEPTH transfers of
    every root; never so small that the memory would hold more than ``most_slots`` (more,
    smaller transfers then buy nothing), nor below MIN_SPREAD_CHUNK (or ``chunk``, if smaller)."""
    if min(chunk, pipeline, most_slots) < 1:
        raise ValueError("chunk, pipeline and most_slots must be at least 1")
    if roots <= 1:
        return chunk
    memory = pipeline * chunk
    fits = memory // (RING_DEPTH * roots)
    power = 1
    while power * 2 <= fits:
        power *= 2
    floor = 1
    while memory // floor > most_slots:  # the smallest power of two that most_slots slots hold
        floor *= 2
    return min(chunk, max(MIN_SPREAD_CHUNK, floor, power))


def spread_roots(loads: Sequence[int]) -> int:
    """How many roots a fan-out of bytes spread as ``loads`` (bytes per root) keeps busy: the
    bytes over the largest root's, rounded (eight equal roots: 8; one root with nearly
    everything, seven with a file each: 1, as a resumed copy sent from one node may be)."""
    largest = max(loads, default=0)
    return max(1, round(sum(loads) / largest)) if largest > 0 else 1


def transfer_schedule(
    plan: Plan,
    slot_size: int,
    ranks: int,
    *,
    root_of: Sequence[int] | None = None,
    receivers_of: Receivers | None = None,
    pack: bool = True,
    tapered: int | None = None,
) -> Transfers:
    """Cut ``plan`` into transfers of at most ``slot_size`` bytes, packed and ordered (see the module).

    ``ranks`` is the size of the broadcast communicator. A piece's root is its shard's
    owner, or ``root_of[owner]`` when the broadcast runs on a smaller communicator than the
    plan (between node leaders: the owner's leader sends). ``receivers_of(file, root)``
    names the ranks that get a file; by default every rank but the root (a full copy on
    every node). A shard the plan names receivers for (``Plan.receivers``: a range some
    copies kept from a stopped run) goes to those only. ``pack=False`` gives every piece
    its own transfer. ``tapered`` (a streamed copy): each root's last piece is cut in halves
    down to that many bytes (:func:`halves`), each its own transfer, so that what leaves
    after the download is over is small (the last of every root crosses every link then).

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
    own = np.zeros(len(p.length), dtype=np.bool_)
    if tapered is not None:
        p, own = _taper(p, tapered)
    direct = (p.length >= DIRECT_MIN) & ((p.offset & (ALIGN - 1)) == 0)  # aligned in the slot if it can be
    opens, at = _pack(p.length, direct, _forced(p, own, slot_size, pack), slot_size)
    del direct
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


def _forced(p: _Pieces, own: np.ndarray, slot_size: int, pack: bool) -> np.ndarray:
    """The pieces that open a transfer whatever came before: every one without packing; else
    a root's first, one with new receivers, one that cannot share a slot with the one before
    (that one is at its slot's offset 0 or later), and one tapered (``own``) and the piece
    after it."""
    forced = np.ones(len(p.length), dtype=np.bool_)
    if pack:
        forced[1:] = (p.root[1:] != p.root[:-1]) | (p.group[1:] != p.group[:-1])
        forced[1:] |= p.length[1:] > slot_size - p.length[:-1]  # (no sum: it could overflow int32)
        forced |= own
        forced[1:] |= own[:-1]
    return forced


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
