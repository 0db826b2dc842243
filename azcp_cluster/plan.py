"""Deterministic LPT bin-packing of files and byte-range shards onto ranks. Pure code.

Every rank calls :func:`make_plan` with the same inputs and gets the same plan, so the
plan never has to be sent over the network. Files larger than ``shard_size`` are split into
near-equal, aligned byte ranges; all pieces are then placed largest first on the
least-loaded rank (ties to the lowest rank): the classic LPT rule, within 4/3 of optimal.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

import numpy as np

# Shard boundaries fall on multiples of this, so O_DIRECT writers never straddle them.
SHARD_ALIGN = 4096


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
