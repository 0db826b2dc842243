"""Unit and property tests for the broadcast schedule (azcp_cluster/schedule.py)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.plan import Plan, Shard, make_plan
from azcp_cluster.schedule import MAX_CALL_BYTES, Chunk, bcast_schedule, call_slices


def test_bcast_schedule_example() -> None:
    plan = Plan(
        shards=(Shard(0, 0, 10, 1), Shard(0, 10, 5, 0), Shard(2, 0, 3, 2), Shard(3, 0, 4, 0)),
        nranks=3,
    )
    assert bcast_schedule(plan, 4) == [
        Chunk(seq=0, file=0, offset=0, length=4, root=1, last_of_file=False),
        Chunk(seq=1, file=0, offset=4, length=4, root=1, last_of_file=False),
        Chunk(seq=2, file=0, offset=8, length=2, root=1, last_of_file=False),
        Chunk(seq=3, file=0, offset=10, length=4, root=0, last_of_file=False),
        Chunk(seq=4, file=0, offset=14, length=1, root=0, last_of_file=True),
        Chunk(seq=5, file=2, offset=0, length=3, root=2, last_of_file=True),
        Chunk(seq=6, file=3, offset=0, length=4, root=0, last_of_file=True),
    ]


def test_bcast_schedule_empty_plan() -> None:
    assert bcast_schedule(Plan(shards=(), nranks=4), 1) == []


@pytest.mark.parametrize("chunk_size", [0, -1])
def test_bcast_schedule_rejects_bad_chunk_size(chunk_size: int) -> None:
    with pytest.raises(ValueError):
        bcast_schedule(Plan(shards=(Shard(0, 0, 1, 0),), nranks=1), chunk_size)


@st.composite
def plans_and_chunk_sizes(draw: st.DrawFn) -> tuple[Plan, list[int], int]:
    sizes = draw(st.lists(st.one_of(st.just(0), st.integers(1, 1 << 22)), max_size=25))
    nranks = draw(st.integers(1, 64))
    shard_size = draw(st.integers(1, 1 << 22))
    total = sum(sizes)
    shard_size = max(shard_size, total // 500 + 1)  # bounded piece count
    plan = make_plan(sizes, range(len(sizes)), nranks, shard_size)
    chunk_size = max(draw(st.integers(1, 1 << 22)), total // 2000 + 1)  # bounded chunk count
    return plan, sizes, chunk_size


@given(plans_and_chunk_sizes())
@settings(max_examples=150, deadline=None)
def test_chunks_cover_each_shard_in_order(args: tuple[Plan, list[int], int]) -> None:
    plan, sizes, chunk_size = args
    chunks = bcast_schedule(plan, chunk_size)
    # seq is consecutive from 0.
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    # Each chunk is non-empty and at most chunk_size.
    assert all(0 < c.length <= chunk_size for c in chunks)
    # Walking the chunks reproduces every shard, in plan order, each cut from its start to its end.
    position = 0
    for shard in plan.shards:
        offset = shard.offset
        while offset < shard.offset + shard.length:
            chunk = chunks[position]
            assert (chunk.file, chunk.offset, chunk.root) == (shard.file, offset, shard.owner)
            offset += chunk.length
            position += 1
        assert offset == shard.offset + shard.length
    assert position == len(chunks)
    # Per file, chunks tile [0, size); empty files have none.
    by_file: dict[int, list[Chunk]] = defaultdict(list)
    for chunk in chunks:
        by_file[chunk.file].append(chunk)
    assert set(by_file) == {i for i, size in enumerate(sizes) if size > 0}
    for index, file_chunks in by_file.items():
        end = 0
        for chunk in file_chunks:
            assert chunk.offset == end
            end += chunk.length
        assert end == sizes[index]
    assert sum(c.length for c in chunks) == sum(sizes)


@given(plans_and_chunk_sizes())
@settings(max_examples=150, deadline=None)
def test_last_of_file(args: tuple[Plan, list[int], int]) -> None:
    plan, _, chunk_size = args
    chunks = bcast_schedule(plan, chunk_size)
    files_in_order = [c.file for c in chunks]
    for i, chunk in enumerate(chunks):
        later_same_file = chunk.file in files_in_order[i + 1 :]
        assert chunk.last_of_file == (not later_same_file)
    # Exactly one closing chunk per file that has chunks.
    assert sum(c.last_of_file for c in chunks) == len(set(files_in_order))
    # A file's chunks are contiguous in the schedule, so closing it never reopens it.
    closed: set[int] = set()
    for chunk in chunks:
        assert chunk.file not in closed
        if chunk.last_of_file:
            closed.add(chunk.file)


def test_call_slices_examples() -> None:
    assert list(call_slices(0)) == []
    assert list(call_slices(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    assert list(call_slices(8, 4)) == [(0, 4), (4, 8)]
    assert list(call_slices(3 * MAX_CALL_BYTES + 1)) == [
        (0, MAX_CALL_BYTES),
        (MAX_CALL_BYTES, 2 * MAX_CALL_BYTES),
        (2 * MAX_CALL_BYTES, 3 * MAX_CALL_BYTES),
        (3 * MAX_CALL_BYTES, 3 * MAX_CALL_BYTES + 1),
    ]


def test_max_call_bytes_fits_a_c_int() -> None:
    assert 0 < MAX_CALL_BYTES <= 2**31 - 1


@pytest.mark.parametrize("limit", [0, -3])
def test_call_slices_rejects_bad_limit(limit: int) -> None:
    with pytest.raises(ValueError):
        list(call_slices(10, limit))


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 32))
@settings(max_examples=300)
def test_call_slices_cover_the_length(length: int, limit: int) -> None:
    if length // limit > 5_000:
        limit = length // 5_000 + 1
    slices = list(call_slices(length, limit))
    end = 0
    for start, stop in slices:
        assert start == end
        assert 0 < stop - start <= limit
        end = stop
    assert end == length
    assert len(slices) == -(-length // limit)


def test_bcast_schedule_maps_owners_to_their_leaders() -> None:
    # Ranks 0,1 on node 0 and ranks 2,3 on node 1: rank 3's download goes out from node 1's leader.
    plan = Plan(shards=(Shard(0, 0, 6, 3), Shard(1, 0, 2, 1)), nranks=4)
    chunks = bcast_schedule(plan, 4, root_of=[0, 0, 1, 1])
    assert [(c.file, c.offset, c.length, c.root) for c in chunks] == [(0, 0, 4, 1), (0, 4, 2, 1), (1, 0, 2, 0)]
    assert [c.root for c in bcast_schedule(plan, 4)] == [3, 3, 1]
