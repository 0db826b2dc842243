"""How a streamed copy cuts its download and its transfers so that parts land, and leave, in waves. Pure code.

Streaming (the download and the fan-out at once) pays only if parts of a rank's share land
before the whole share has: a transfer goes out once all its bytes are on its node. Ranged
GETs in flight together share the node's link and finish together, so with a share of two
16 MiB blocks and 64 requests allowed, both blocks land at the very end and nothing leaves
before the download is over (the cluster benchmark, issue 24: streaming no faster than two
phases). So, for a streamed copy only:

* the share is fetched in at least WAVES waves: no more requests in flight than a WAVES-th
  of its blocks, and blocks small enough (down to MIN_BLOCK) that a wave of ``--concurrency``
  requests is a WAVES-th of the share;
* transfers (fan-out slots) are at most a SLOTS-th of the share (down to MIN_CHUNK), so the
  last ones, which leave after the download, are small.

A share large against ``--concurrency`` × ``--block-size`` (4 GiB at the defaults) is cut
exactly as without streaming: it lands in waves already. Blocks stay at MIN_BLOCK or more:
the emulator's cost per ranged GET grows with the blob, not the range (64 MiB blobs on
loopback: 2 and 4 MiB blocks took the download from 0.33 to 0.75 s, 8 MiB blocks did not),
and a service's cost per request is never nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
WAVES = 4  # a share lands in four waves: the first goes out while three are still coming
# A sixteenth, not an eighth: what lands last is a transfer per request in flight, and goes
# out after the download (docs/benchmarks.md has the two timed).
SLOTS = 16
MIN_BLOCK = 8 * MiB  # below it a ranged GET's fixed cost shows (see the docstring)
MIN_CHUNK = 1 * MiB  # below it a transfer's per-message costs show
# Each downloader's last block is cut into halves down to this (core/blocks.taper): what
# lands last, and is sent after the download is over, is a few MiB in all, not a block per
# node (docs/benchmarks.md).
TAPER = 1 * MiB


@dataclass(frozen=True)
class StreamSizes:
    """A streamed copy's transfer size (``chunk``), ranged-GET size (``block``) and requests in flight."""

    chunk: int
    block: int
    in_flight: int


def _power_of_two_at_most(value: float) -> int:
    power = 1
    while power * 2 <= value:
        power *= 2
    return power


def stream_sizes(share: int, chunk: int, block: int, concurrency: int) -> StreamSizes:
    """The sizes for a streamed copy whose largest download share is ``share`` bytes, from the
    configured ``chunk`` (bytes per transfer), ``block`` (bytes per ranged GET) and
    ``concurrency`` (requests in flight): never larger than configured (see the module)."""
    if chunk < 1 or block < 1 or concurrency < 1:
        raise ValueError("chunk, block and concurrency must be at least 1")
    if share <= 0:
        return StreamSizes(chunk, block, concurrency)
    small_chunk = max(MIN_CHUNK, _power_of_two_at_most(share / SLOTS))
    small_block = max(MIN_BLOCK, _power_of_two_at_most(share / (WAVES * concurrency)))
    new_chunk = min(chunk, small_chunk)
    new_block = min(block, small_block)
    blocks = -(-share // new_block)
    in_flight = max(1, min(concurrency, blocks // WAVES))
    return StreamSizes(new_chunk, new_block, in_flight)


__all__ = ["MIN_BLOCK", "MIN_CHUNK", "SLOTS", "TAPER", "WAVES", "StreamSizes", "stream_sizes"]
