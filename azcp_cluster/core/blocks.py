"""Block arithmetic: shards cut into ranged GETs, the GETs dealt to processes and to a node's
downloaders, and the sizes of the download's buffer pool. Pure: no I/O.

The download (:mod:`azcp_cluster.download`) fetches these blocks, the streaming stage counts
them as they land, and the allocation and the start-up memory check size the pool by them:
each of those asks here, so that they all cut, deal and count alike.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from azcp_cluster.core.config import MiB
from azcp_cluster.core.packing import halves
from azcp_cluster.core.plan import Plan, Shard
from azcp_cluster.core.schedule import Landing, Transfer

# One pool buffer: the body is received into it, and it is written with one O_DIRECT call
# when full. O_DIRECT costs CPU per call (0.19 CPU-s/GiB at 1 MiB, 0.09 at 4 MiB here), and
# the disk keeps pace better with fewer, larger writes; 2 MiB keeps the pool's memory at
# what it was when bodies were copied into 1 MiB buffers.
BUFFER_BYTES = 2 * MiB
# The pool: one buffer per request in flight plus these spares, so that every request can
# receive while the writers write ((concurrency + 8) x 2 MiB: 144 MiB at the default 64).
# A request holds at most one buffer and takes the next only after handing the full one
# to the writers, so it never waits for a buffer while holding one.
SPARE_BUFFERS = 8
# The most fan-out slots a leader maps for smaller transfers than --bcast-chunk (each slot is
# a transfer in flight: its requests, its writes, its place in the agreement every 16).
MAX_SLOTS = 64


@dataclass(frozen=True)
class Block:
    """One ranged GET: ``length`` bytes of file ``file`` at ``offset``."""

    file: int
    offset: int
    length: int


def blocks_for(shards: Sequence[Shard], block_size: int) -> list[Block]:
    """Cut shards into ranged-GET blocks of at most ``block_size`` bytes."""
    blocks = []
    for shard in shards:
        offset, end = shard.offset, shard.offset + shard.length
        while offset < end:
            length = min(block_size, end - offset)
            blocks.append(Block(shard.file, offset, length))
            offset += length
    return blocks


def requests_for(blocks: Sequence[Block], request_bytes: int) -> list[list[Block]]:
    """``blocks`` (in download order) as ranged GETs: each run of consecutive blocks that follow
    one another in one file, up to ``request_bytes`` together, is one request.

    A streamed copy cuts its shares into blocks as small as its transfers, so that each lands
    (and its transfer leaves) as soon as its bytes are on the disk, while its GETs stay as
    large as ``--block-size`` allows: a service's cost per request is never nothing. Blocks of
    ``request_bytes`` each (every copy that does not stream) stay one request each.
    """
    if request_bytes < 1:
        raise ValueError("request_bytes must be at least 1")
    out: list[list[Block]] = []
    size = 0
    for block in blocks:
        if out:
            last = out[-1][-1]
            follows = block.file == last.file and block.offset == last.offset + last.length
            if follows and size + block.length <= request_bytes:
                out[-1].append(block)
                size += block.length
                continue
        out.append([block])
        size = block.length
    return out


def taper(block: Block, smallest: int) -> list[Block]:
    """``block`` cut into halves of what is left (L/2, L/4, …, down to ``smallest``, multiples of
    it: :func:`azcp_cluster.core.packing.halves`), then the rest: a downloader's last block, so
    that what lands last, and must still be sent after the download is over, is small (streaming)."""
    out: list[Block] = []
    offset = block.offset
    for length in halves(block.length, smallest):
        out.append(Block(block.file, offset, length))
        offset += length
    return out


def deal(blocks: Sequence[Block], workers: int) -> list[list[Block]]:
    """Split ``blocks`` over ``workers``: largest first, each to the least loaded (LPT), order kept within each."""
    loads = [(0, w) for w in range(workers)]  # a heap of (load, worker)
    parts: list[list[tuple[int, Block]]] = [[] for _ in range(workers)]
    for index, block in sorted(enumerate(blocks), key=lambda ib: (-ib[1].length, ib[0])):
        load, k = heapq.heappop(loads)
        parts[k].append((index, block))
        heapq.heappush(loads, (load + block.length, k))
    return [[block for _, block in sorted(part, key=lambda ib: ib[0])] for part in parts]


def deal_requests(blocks: Sequence[Block], workers: int, request_bytes: int) -> list[list[Block]]:
    """:func:`deal` a whole request (:func:`requests_for`) at a time: a worker's consecutive
    blocks stay one ranged GET (dealt block by block, 2 MiB streamed blocks went out as 2 MiB
    GETs, not the 8 MiB ones they make together)."""
    requests = requests_for(blocks, request_bytes)
    heads = [Block(r[0].file, r[0].offset, sum(b.length for b in r)) for r in requests]
    by_head = {(h.file, h.offset): r for h, r in zip(heads, requests, strict=True)}
    return [[b for head in part for b in by_head[(head.file, head.offset)]] for part in deal(heads, workers)]


@dataclass(frozen=True)
class NodeBlocks:
    """The ranged GETs of one node's downloaders: ``blocks`` in download order, and each one's slice."""

    blocks: tuple[tuple[int, int, int], ...]  # (file, offset, length), node-wide index = position
    of_rank: dict[int, tuple[int, ...]]  # downloader -> its block indices, in the order it fetches them


def node_blocks(
    schedule: Sequence[Transfer],
    plan: Plan,
    node: int,
    downloaders: Sequence[int],
    block_size: int,
    tapered: int | None = None,
) -> tuple[NodeBlocks, Landing]:
    """The blocks of ``node``'s ``downloaders`` (world ranks) and when each of its transfers is ready.

    Each downloader's shards are cut by :func:`blocks_for` and fetched in the order the
    schedule needs them; ``tapered``: each downloader's last block is cut by :func:`taper`
    down to that many bytes. Every rank of the node derives the same list, so a block is
    named by its index in it.
    """
    blocks: list[tuple[int, int, int]] = []
    owner: list[int] = []
    for rank in downloaders:
        for block in blocks_for(plan.owned_by(rank), block_size):
            blocks.append((block.file, block.offset, block.length))
            owner.append(rank)
    landing = Landing(schedule, node, blocks)
    order = landing.order()
    if tapered is not None and blocks:
        last = {owner[index]: index for index in order}  # each downloader's last to land
        cut: list[tuple[int, int, int]] = []
        cut_owner: list[int] = []
        for index, (at, rank) in enumerate(zip(blocks, owner, strict=True)):
            whole = Block(*at)
            pieces = taper(whole, tapered) if last.get(rank) == index else [whole]
            cut += [(b.file, b.offset, b.length) for b in pieces]
            cut_owner += [rank] * len(pieces)
        blocks, owner = cut, cut_owner
        landing = Landing(schedule, node, blocks)
        order = landing.order()
    of_rank: dict[int, list[int]] = {rank: [] for rank in downloaders}
    for index in order:
        of_rank[owner[index]].append(index)
    return NodeBlocks(tuple(blocks), {r: tuple(v) for r, v in of_rank.items()}), landing


def pool_buffers(concurrency: int) -> int:
    """Buffers in the download pool: one per request in flight, plus spares."""
    return concurrency + SPARE_BUFFERS


def pool_buffers_for(concurrency: int, blocks: int) -> int:
    """Buffers for a rank with ``blocks`` ranged GETs to make: never more than they can fill at once."""
    return min(pool_buffers(concurrency), blocks + SPARE_BUFFERS)


def holdable(buffers: int, requests: int, per_transfer: int) -> int:
    """How many written buffers a streaming leader's pool may hold for its fan-out to send from
    memory (``WritePool.hold_written``): what ``requests`` in flight, one buffer each, and half
    the spares leave of ``buffers``, if that holds a whole transfer (``per_transfer`` buffers);
    else none, since a transfer held in part is read from the disk all the same (a share of
    256 MiB or more streams 16 MiB transfers, 8 buffers, and 4 are spare).

    What is held returns when the fan-out copies it; meanwhile the download has fewer spares,
    and a request that finds none waits for a write to end, never for the fan-out."""
    if buffers < 0 or requests < 0 or per_transfer < 1:
        raise ValueError("buffers and requests must not be negative, per_transfer at least 1")
    spare = buffers - requests - SPARE_BUFFERS // 2
    return spare if spare >= per_transfer else 0


def pool_bytes(concurrency: int) -> int:
    """Memory the download pool takes at most (stated in the README, checked at start-up)."""
    return pool_buffers(concurrency) * BUFFER_BYTES


def fanout_slots(pipeline: int, chunk: int, slot: int, transfers: int) -> int:
    """How many slots the fan-out maps: the memory of ``pipeline`` slots of ``chunk`` bytes
    (``--bcast-pipeline`` x ``--bcast-chunk``, the memory the README states and start-up checks),
    cut into slots of ``slot`` bytes (the largest transfer), at most MAX_SLOTS and one per
    transfer. A streamed copy's transfers are small (a share's eighth) so that they leave
    early; as few slots as configured would leave the fabric idle between them (eight hosts
    in the box: 4 slots of 2 MiB, 4.8 s; 16, 4.2 s), so it gets more of them in the same memory."""
    if min(pipeline, chunk, slot, transfers) < 1:
        raise ValueError("pipeline, chunk, slot and transfers must be at least 1")
    return max(1, min(transfers, max(pipeline, min(MAX_SLOTS, pipeline * chunk // slot))))


__all__ = [
    "BUFFER_BYTES",
    "MAX_SLOTS",
    "SPARE_BUFFERS",
    "Block",
    "NodeBlocks",
    "blocks_for",
    "deal",
    "deal_requests",
    "fanout_slots",
    "holdable",
    "node_blocks",
    "pool_buffers",
    "pool_buffers_for",
    "pool_bytes",
    "requests_for",
]
