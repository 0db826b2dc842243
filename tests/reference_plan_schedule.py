"""The plan and the schedule as main had them before they went column-wise (55af407), kept as
the oracle of the differential tests (tests/test_scale_differential.py): the same LPT, the same
transfers, in the same order. Not used by the tool; change nothing here but to follow a
deliberate, tested change of the tool's results.
"""

# ruff: noqa
# mypy: ignore-errors

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np

from azcp_cluster.core.plan import Shard
from azcp_cluster.core.schedule import Extent

SHARD_ALIGN = 4096
MAX_CALL_BYTES = 1 << 30
DIRECT_MIN = 64 * 1024
MAX_EXTENTS = 1024
ALIGN = SHARD_ALIGN


@dataclass(frozen=True)
class Plan:
    """Who fetches what. ``shards`` are sorted by (file, offset): the broadcast order."""

    shards: tuple[Shard, ...]
    nranks: int
    # A peer shard of a file that some nodes hold only in part (a resumed run): the ranks
    # (leaders) that lack it, keyed by (file, offset). Every other shard goes to everyone.
    receivers: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    def loads(self) -> list[int]:
        """Bytes each rank downloads (peer shards cost no download)."""
        loads = [0] * self.nranks
        for shard in self.shards:
            if not shard.peer:
                loads[shard.owner] += shard.length
        return loads

    def owned_by(self, rank: int) -> list[Shard]:
        """The shards one rank downloads, in broadcast order."""
        return [s for s in self.shards if s.owner == rank and not s.peer]

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


# Shards sort by where they are, (file, offset): unique, so the same order as comparing the
# whole dataclass, at a fraction of the cost (a million shards: 12 s of __lt__ calls before).
_by_place = attrgetter("file", "offset")


def make_plan(
    sizes: Sequence[int],
    files: Sequence[int],
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
    # Every piece, column-wise: most files are one piece (made without a call), the few
    # larger than a shard are split, then what a resumed run lacks.
    chosen = np.asarray(files, dtype=np.int64)
    lengths = np.asarray(sizes, dtype=np.int64)[chosen] if len(chosen) else np.zeros(0, dtype=np.int64)
    whole = (lengths > 0) & (lengths <= shard_size)
    extra: list[tuple[int, int, int]] = []
    for index in chosen[lengths > shard_size].tolist():
        extra.extend((index, offset, length) for offset, length in split_ranges(sizes[index], shard_size))
    for index, start, size in ranges:
        extra.extend((index, start + offset, length) for offset, length in split_ranges(size, shard_size))
    more = np.array(extra, dtype=np.int64).reshape(-1, 3)
    file_of = np.concatenate((chosen[whole], more[:, 0]))
    offset_of = np.concatenate((np.zeros(int(whole.sum()), dtype=np.int64), more[:, 1]))
    length_of = np.concatenate((lengths[whole], more[:, 2]))
    # Where they are, (file, offset): the plan's order; and largest first, ties by place,
    # for the LPT (lexsort is stable and the same on every rank: every rank gets one plan).
    place = np.lexsort((offset_of, file_of))
    file_of, offset_of, length_of = file_of[place], offset_of[place], length_of[place]
    largest = np.lexsort((offset_of, file_of, -length_of))
    heap = [(0, rank) for rank in candidates]
    heapq.heapify(heap)
    owner = [0] * len(length_of)
    replace = heapq.heapreplace
    for piece, length in zip(largest.tolist(), length_of[largest].tolist(), strict=True):
        load, rank = heap[0]
        owner[piece] = rank
        replace(heap, (load + length, rank))  # one sift instead of a pop and a push
    shards = map(Shard._make, zip(file_of.tolist(), offset_of.tolist(), length_of.tolist(), owner, repeat(False)))
    return Plan(shards=tuple(shards), nranks=nranks)


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
    azure = [i for i, have in enumerate(holders) if not have and i not in partial]
    missing = [(i, off, length) for i, segs in partial.items() for off, length, by in segs if not by]
    plan = make_plan(sizes, azure, nranks, shard_size, owners, missing)
    peer = [
        Shard(file=i, offset=offset, length=length, owner=min(have), peer=True)
        for i, have in enumerate(holders)
        if have and len(set(have)) < needed and i not in partial
        for offset, length in split_ranges(sizes[i], shard_size)
    ]
    to: dict[tuple[int, int], tuple[int, ...]] = {}
    everyone = tuple(range(nranks)) if receivers is None else tuple(sorted(receivers))
    for i, segs in partial.items():
        for start, size, by in segs:
            if not by or len(set(by)) >= needed:
                continue
            lacking = tuple(r for r in everyone if r not in by)
            for offset, length in split_ranges(size, shard_size):
                peer.append(Shard(file=i, offset=start + offset, length=length, owner=min(by), peer=True))
                to[(i, start + offset)] = lacking
    if not peer:  # a first copy: the plan's own shards, already in order
        return Plan(shards=plan.shards, nranks=nranks)
    return Plan(shards=tuple(sorted((*plan.shards, *peer), key=_by_place)), nranks=nranks, receivers=to)


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
