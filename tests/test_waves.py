"""A streamed copy's sizes (core/waves.py): parts land, and leave, in waves; never larger than configured."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.blocks import MAX_SLOTS, Block, fanout_slots, node_blocks, taper
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.packing import MIN_SPREAD_CHUNK, RING_DEPTH, spread_chunk, spread_roots, transfer_schedule
from azcp_cluster.core.plan import make_plan
from azcp_cluster.core.waves import MIN_BLOCK, MIN_CHUNK, SLOTS, WAVES, stream_sizes

MiB = 1 << 20
GiB = 1 << 30


@settings(max_examples=500, deadline=None)
@given(
    st.integers(1, 1 << 44),
    st.sampled_from([64 << 10, MiB, 16 * MiB, 64 * MiB, GiB]),
    st.sampled_from([64 << 10, MiB, 16 * MiB, 64 * MiB]),
    st.integers(1, 1024),
)
def test_sizes_never_grow_and_a_share_lands_in_waves(share: int, chunk: int, block: int, concurrency: int) -> None:
    sizes = stream_sizes(share, chunk, block, concurrency)
    assert sizes.chunk <= chunk and sizes.block <= block and 1 <= sizes.in_flight <= concurrency
    assert sizes.chunk == chunk or sizes.chunk >= MIN_CHUNK
    assert sizes.block == block or sizes.block >= MIN_BLOCK
    blocks = -(-share // sizes.block)
    if blocks >= WAVES:  # at least WAVES waves of requests
        assert sizes.in_flight * WAVES <= blocks
    else:
        assert sizes.in_flight == 1
    if sizes.chunk < chunk and sizes.chunk > MIN_CHUNK:  # the last slots are a small part of the share
        assert sizes.chunk * SLOTS <= share


def test_a_large_share_is_cut_as_without_streaming() -> None:
    sizes = stream_sizes(100 * GiB, 16 * MiB, 16 * MiB, 64)
    assert (sizes.chunk, sizes.block, sizes.in_flight) == (16 * MiB, 16 * MiB, 64)
    # From WAVES x concurrency x block on: 4 GiB at the defaults.
    edge = stream_sizes(WAVES * 64 * 16 * MiB, 16 * MiB, 16 * MiB, 64)
    assert (edge.block, edge.in_flight) == (16 * MiB, 64)


def test_the_box_share_that_streamed_no_faster_than_two_phases() -> None:
    """Issue 24's case: 32 MiB per host (128 MiB over 4 hosts), two 16 MiB blocks in flight at
    once, both landing at the end. Now four 8 MiB blocks one after the other, 2 MiB transfers."""
    sizes = stream_sizes(32 * MiB, 16 * MiB, 16 * MiB, 64)
    assert (sizes.chunk, sizes.block, sizes.in_flight) == (2 * MiB, 8 * MiB, 1)


@pytest.mark.parametrize("bad", [(1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)])
def test_nonsense_is_refused(bad: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        stream_sizes(*bad)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64 * MiB), st.sampled_from([4096, 256 << 10, MiB]), st.integers(0, 10**9))
def test_a_tapered_block_is_the_same_bytes_in_halves_down_to_the_smallest(length: int, smallest: int, at: int) -> None:
    block = Block(3, at * 4096, length)
    pieces = taper(block, smallest)
    assert pieces[0].offset == block.offset and sum(p.length for p in pieces) == length
    assert all(a.offset + a.length == b.offset for a, b in itertools.pairwise(pieces))
    assert all(p.file == 3 and p.length > 0 for p in pieces)
    assert all(p.length % smallest == 0 for p in pieces[:-1])  # aligned as the block was
    assert all(a.length >= b.length for a, b in itertools.pairwise(pieces[:-1]))
    assert pieces[-1].length <= max(smallest, length)
    if length > smallest:  # cut down to less than two of the smallest (aligned cuts only)
        assert pieces[-1].length < 2 * smallest


def test_each_downloader_fetches_its_tapered_last_block_last() -> None:
    """Two downloaders of one node, a file each; their last blocks land as 4, 2, 1 and 1 MiB."""
    sizes = [40 * MiB, 24 * MiB]
    plan = make_plan(sizes, range(2), 2, GiB)
    files = [FileEntry(name=f"f{i}", path=f"f{i}", size=n) for i, n in enumerate(sizes)]
    schedule = transfer_schedule(plan, 4 * MiB, 1)
    plain, _ = node_blocks(schedule, plan, 0, [0, 1], 8 * MiB)
    cut, _ = node_blocks(schedule, plan, 0, [0, 1], 8 * MiB, tapered=MiB)
    assert len(cut.blocks) == len(plain.blocks) + 2 * 3
    for rank in (0, 1):
        mine = [cut.blocks[i] for i in cut.of_rank[rank]]
        assert [length for _, _, length in mine[-4:]] == [4 * MiB, 2 * MiB, MiB, MiB]
        covered = sorted((o, o + n) for _, o, n in mine)
        assert covered[0][0] == 0 and covered[-1][1] == files[mine[0][0]].size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


# -- a copy that does not stream, its bytes on several nodes: every root round the ring at once


@settings(max_examples=300, deadline=None)
@given(
    chunk=st.integers(1, 1 << 30),
    pipeline=st.integers(1, 64),
    roots=st.integers(1, 512),
)
def test_spread_transfers_let_every_root_be_in_flight(chunk: int, pipeline: int, roots: int) -> None:
    size = spread_chunk(chunk, pipeline, roots, MAX_SLOTS)
    assert 1 <= size <= chunk  # never larger than --bcast-chunk, nor more memory
    if roots == 1:
        assert size == chunk  # one reader: one chain, as before
        return
    assert size == chunk or size & (size - 1) == 0  # a power of two, or the chunk itself
    memory = pipeline * chunk
    if size < chunk:
        # Cut only to fit more slots: never more than MAX_SLOTS of them (more buys nothing)...
        assert memory // size <= MAX_SLOTS
        # ...and no smaller than RING_DEPTH transfers of every root need, unless a half as large
        # would no longer fit MAX_SLOTS or be too small a message.
        enough = memory // size >= RING_DEPTH * roots
        assert enough or memory // (size // 2) > MAX_SLOTS or size == MIN_SPREAD_CHUNK
        # It is the largest size that does it (or the floor): twice as large holds too few.
        assert memory // (2 * size) < RING_DEPTH * roots or memory // size > MAX_SLOTS // 2 or size == MIN_SPREAD_CHUNK


def test_eight_roots_of_sixteen_mebibyte_transfers_in_four_slots_go_round_at_once() -> None:
    """The box's two-phase copy at 8 hosts: 8 transfers of 16 MiB in 4 slots went round in two
    halves; 4 MiB transfers in 16 slots hold two of every root's."""
    assert spread_chunk(16 << 20, 4, 8, MAX_SLOTS) == 4 << 20
    assert fanout_slots(4, 16 << 20, 4 << 20, 32) == 16 == RING_DEPTH * 8
    assert spread_chunk(16 << 20, 4, 1, MAX_SLOTS) == 16 << 20
    assert spread_chunk(16 << 20, 4, 512, MAX_SLOTS) == MIN_SPREAD_CHUNK  # never a message of crumbs
    # 64 roots, 256 MiB of slots: 4 MiB fills the 64 slots there can be; 2 MiB would too, in
    # twice the transfers (the review's case).
    assert spread_chunk(16 << 20, 16, 64, MAX_SLOTS) == 4 << 20
    assert fanout_slots(16, 16 << 20, 4 << 20, 10_000) == MAX_SLOTS
    with pytest.raises(ValueError):
        spread_chunk(0, 4, 2, MAX_SLOTS)


@pytest.mark.parametrize(
    ("loads", "roots"),
    [([8, 8, 8, 8, 8, 8, 8, 8], 8), ([100, 1, 1, 1, 1, 1, 1, 1], 1), ([50, 50, 1, 1], 2), ([], 1), ([0, 0], 1),
     ([5, 0, 5, 0], 2)],
)  # fmt: skip
def test_the_roots_a_spread_fan_out_keeps_busy_are_weighed_by_their_bytes(loads: list[int], roots: int) -> None:
    """A resumed copy that one node sends nearly all of is one chain, not eight."""
    assert spread_roots(loads) == roots
