"""The broadcast schedule: which bytes go from which rank, in which order. Pure code.

The schedule is data, derived identically on every rank from the plan, so the broadcast
engine only walks a list. A new fan-out mode (streaming, allgather, scatter) is a new
schedule, not a new engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from azcp_cluster.plan import Plan

# MPI counts are C ints; the reference tool splits each call at 1 GiB to stay well below.
MAX_CALL_BYTES = 1 << 30


@dataclass(frozen=True)
class Chunk:
    """``length`` bytes of file ``file`` at ``offset``, sent by rank ``root`` to every rank."""

    seq: int  # position in the schedule
    file: int
    offset: int
    length: int
    root: int
    last_of_file: bool  # no later chunk of this file follows: it may be closed


def bcast_schedule(plan: Plan, chunk_size: int, root_of: Sequence[int] | None = None) -> list[Chunk]:
    """Cut every shard of ``plan`` into chunks of at most ``chunk_size`` bytes, in plan order.

    A chunk's root is its shard's owner, or ``root_of[owner]`` when the broadcast runs on a
    smaller communicator than the plan (between node leaders: the owner's leader sends).
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    pieces: list[tuple[int, int, int, int]] = []
    for shard in plan.shards:
        offset = shard.offset
        end = shard.offset + shard.length
        while offset < end:
            length = min(chunk_size, end - offset)
            pieces.append((shard.file, offset, length, shard.owner if root_of is None else root_of[shard.owner]))
            offset += length
    chunks = []
    for seq, (file, offset, length, root) in enumerate(pieces):
        last = seq + 1 == len(pieces) or pieces[seq + 1][0] != file
        chunks.append(Chunk(seq=seq, file=file, offset=offset, length=length, root=root, last_of_file=last))
    return chunks


def call_slices(length: int, limit: int = MAX_CALL_BYTES) -> Iterator[tuple[int, int]]:
    """Split one chunk into ``(start, stop)`` slices of at most ``limit`` bytes for MPI calls."""
    if limit <= 0:
        raise ValueError("limit must be positive")
    start = 0
    while start < length:
        stop = min(length, start + limit)
        yield start, stop
        start = stop
