"""The transfer schedule: which bytes go from which node to which, in which order and slot. Pure code.

The schedule is data, derived identically on every rank from the plan, so the fan-out
engine (:mod:`azcp_cluster.fanout` decides, :mod:`azcp_cluster.broadcast` drives) only
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
from dataclasses import dataclass
from typing import Any, NamedTuple

from azcp_cluster.plan import SHARD_ALIGN, Plan

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


@dataclass(frozen=True)
class Transfer:
    """One slot's worth of bytes, sent by ``root`` to ``receivers`` (ranks of the broadcast communicator)."""

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


def transfer_schedule(
    plan: Plan,
    slot_size: int,
    ranks: int,
    *,
    root_of: Sequence[int] | None = None,
    receivers_of: Receivers | None = None,
    pack: bool = True,
) -> list[Transfer]:
    """Cut ``plan`` into transfers of at most ``slot_size`` bytes, packed and ordered (see the module).

    ``ranks`` is the size of the broadcast communicator. A piece's root is its shard's
    owner, or ``root_of[owner]`` when the broadcast runs on a smaller communicator than the
    plan (between node leaders: the owner's leader sends). ``receivers_of(file, root)``
    names the ranks that get a file; by default every rank but the root (a full copy on
    every node). A shard the plan names receivers for (``Plan.receivers``: a range some
    copies kept from a stopped run) goes to those only. ``pack=False`` gives every piece
    its own transfer.
    """
    if slot_size <= 0:
        raise ValueError("slot_size must be positive")
    everyone_but: dict[int, tuple[int, ...]] = {}

    def default(root: int) -> tuple[int, ...]:
        to = everyone_but.get(root)
        if to is None:
            to = everyone_but[root] = tuple(r for r in range(ranks) if r != root)
        return to

    shards = plan.shards
    roots = [s.owner for s in shards] if root_of is None else [root_of[s.owner] for s in shards]
    loads: dict[int, int] = {}
    for shard, root in zip(shards, roots, strict=True):
        loads[root] = loads.get(root, 0) + shard.length
    named = plan.receivers
    # Per root: its open transfer, [receivers, extents, bytes used, root's bytes so far at its
    # end], and its closed ones with their landing keys. A root's pieces come in plan order,
    # (file, offset), so a file's pieces from one root are consecutive: an extent stops being
    # its file's last when the next piece of that file comes (made again, rarely: most files
    # are one piece).
    open_: dict[int, list[Any]] = {}
    closed: list[tuple[float, int, int, list[Any]]] = []  # (landing key, root, index, transfer)
    done_bytes: dict[int, int] = dict.fromkeys(loads, 0)
    count: dict[int, int] = dict.fromkeys(loads, 0)
    previous: dict[int, tuple[list[Extent], int]] = {}  # root -> where its last extent so far is

    def close(root: int) -> None:
        building = open_.pop(root, None)
        if building is not None:
            key = building[3] / loads[root] if loads[root] else 0.0
            closed.append((key, root, count[root], building))
            count[root] += 1

    for shard, root in zip(shards, roots, strict=True):
        file, offset, length_left = shard.file, shard.offset, shard.length
        if length_left <= 0:
            continue  # no bytes, no extent (and the file's last extent stays its last)
        to = named.get((file, offset)) if named else None
        if to is not None:  # a resumed run: only the copies that lack this range
            to = tuple(sorted({r if root_of is None else root_of[r] for r in to} - {root}))
        elif receivers_of is None:
            to = default(root)  # sorted, without the root, one object per root
        else:
            to = tuple(sorted(set(receivers_of(file, root)) - {root}))
        end = offset + length_left
        last = previous.get(root)
        if last is not None and last[0][last[1]].file == file:
            last[0][last[1]] = last[0][last[1]]._replace(last_of_file=False)
        while offset < end:
            length = min(slot_size, end - offset)
            building = open_.get(root)
            at = 0
            if building is not None:
                used = building[2]
                # Aligned if it can be written with O_DIRECT, else packed tight.
                at = -(-used // ALIGN) * ALIGN if length >= DIRECT_MIN and offset % ALIGN == 0 else used
                # "is" first: a million shards to 1,023 receivers compared item by item took seconds.
                same = building[0] is to or building[0] == to
                if not pack or not same or at + length > slot_size or len(building[1]) >= MAX_EXTENTS:
                    close(root)
                    building = None
                    at = 0
            if building is None:
                building = open_[root] = [to, [], 0, 0]
            extents = building[1]
            # Not the last when more of this shard follows, in a later slot.
            extents.append(Extent(file, offset, length, at, offset + length >= end))
            building[2] = at + length
            done_bytes[root] += length
            building[3] = done_bytes[root]
            offset += length
            previous[root] = (extents, len(extents) - 1)
    for root in list(open_):
        close(root)
    # Expected landing first; a root's transfers keep their order (their keys only grow).
    closed.sort(key=lambda item: (item[0], item[1], item[2]))
    return [
        Transfer(
            seq=seq,
            root=root,
            receivers=building[0],
            extents=tuple(building[1]),
            everyone=len(building[0]) == ranks - 1,
        )
        for seq, (_, root, _, building) in enumerate(closed)
    ]


def files_written(schedule: Sequence[Transfer], rank: int) -> set[int]:
    """The files with some extent that ``rank`` sends or receives: the files its node writes
    (a root writes what its node downloaded, or its own copy of what it reads from a source),
    unless the node already has them."""
    return {e.file for t in schedule if t.involves(rank) for e in t.extents}


def completions(schedule: Sequence[Transfer]) -> list[int]:
    """Per transfer, how many files it completes (their last extent in schedule order is in it)."""
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
    position: dict[int, int] = {}
    broken: set[int] = set()
    for transfer in schedule:
        seen = transfer.involves(rank)
        for extent in transfer.extents:
            if not seen or position.get(extent.file, 0) != extent.offset:
                broken.add(extent.file)
            position[extent.file] = extent.offset + extent.length
    return {f for f, end in position.items() if f not in broken and end == sizes[f]}


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
        for transfer in schedule:
            if transfer.root != root:
                continue
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
