"""Unit and property tests for the transfer schedule (azcp_cluster/core/schedule.py, packing.py)."""

from __future__ import annotations

import bisect
import itertools
import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.packing import MAX_EXTENTS, halves, transfer_schedule
from azcp_cluster.core.plan import Plan, Shard, make_plan
from azcp_cluster.core.schedule import (
    ALIGN,
    DIRECT_MIN,
    MAX_CALL_BYTES,
    Extent,
    Landing,
    Transfer,
    Transfers,
    call_slices,
    completions,
    files_of,
    files_written,
    involving,
    max_length,
    payload,
    streamed_files,
    transfers_at,
)


def test_example_cuts_large_pieces_and_packs_small_ones() -> None:
    plan = Plan(
        shards=(Shard(0, 0, 10, 1), Shard(0, 10, 5, 0), Shard(2, 0, 3, 2), Shard(3, 0, 4, 0)),
        nranks=3,
    )
    # Ordered by the share of each root's bytes that has landed at a transfer's end: rank
    # 1's 4 of 10 (0.4), rank 0's 4 of 9 (0.44), 5 of 9, rank 1's 8 of 10, then the last of
    # each (1.0), lowest root first. Rank 0's 1-byte tail and its 4-byte file do not fit
    # one slot of 4 together.
    assert transfer_schedule(plan, 4, 3) == [
        Transfer(0, 1, (0, 2), (Extent(0, 0, 4, 0, False),), True),
        Transfer(1, 0, (1, 2), (Extent(0, 10, 4, 0, False),), True),
        Transfer(2, 0, (1, 2), (Extent(0, 14, 1, 0, True),), True),  # rank 0's last of file 0
        Transfer(3, 1, (0, 2), (Extent(0, 4, 4, 0, False),), True),
        Transfer(4, 0, (1, 2), (Extent(3, 0, 4, 0, True),), True),
        Transfer(5, 1, (0, 2), (Extent(0, 8, 2, 0, True),), True),  # rank 1's last of file 0
        Transfer(6, 2, (0, 1), (Extent(2, 0, 3, 0, True),), True),
    ]


def test_small_files_share_a_slot_tightly_and_large_ones_stay_aligned() -> None:
    sizes = [100, 200, DIRECT_MIN + 5, 7]
    plan = make_plan(sizes, range(4), 1, 1 << 30)
    [transfer] = transfer_schedule(plan, 1 << 20, 2)
    assert [(e.file, e.at) for e in transfer.extents] == [(0, 0), (1, 100), (2, ALIGN), (3, ALIGN + DIRECT_MIN + 5)]
    assert [e.direct for e in transfer.extents] == [False, False, True, False]
    assert transfer.receivers == (1,) and transfer.everyone


def test_no_packing_gives_every_piece_its_own_transfer() -> None:
    plan = make_plan([1, 2, 3], range(3), 1, 1 << 30)
    assert [len(t.extents) for t in transfer_schedule(plan, 1 << 20, 2, pack=False)] == [1, 1, 1]


def test_a_slot_holds_at_most_max_extents() -> None:
    plan = make_plan([1] * (MAX_EXTENTS + 1), range(MAX_EXTENTS + 1), 1, 1 << 30)
    assert [len(t.extents) for t in transfer_schedule(plan, 1 << 30, 2)] == [MAX_EXTENTS, 1]


def test_empty_plan() -> None:
    assert transfer_schedule(Plan(shards=(), nranks=4), 1, 4) == []


@pytest.mark.parametrize("slot_size", [0, -1])
def test_rejects_bad_slot_size(slot_size: int) -> None:
    with pytest.raises(ValueError):
        transfer_schedule(Plan(shards=(Shard(0, 0, 1, 0),), nranks=1), slot_size, 1)


def test_owners_map_to_their_leaders() -> None:
    plan = Plan(shards=(Shard(0, 0, 4, 2), Shard(1, 0, 4, 3), Shard(2, 0, 4, 1)), nranks=4)
    assert {t.root for t in transfer_schedule(plan, 4, 2, root_of=[0, 0, 1, 1])} == {0, 1}


def test_receivers_subset_is_a_point_to_point_transfer() -> None:
    plan = make_plan([10, 10], range(2), 1, 1 << 30)
    schedule = transfer_schedule(plan, 100, 3, receivers_of=lambda file, root: (2,) if file else (1, 2))
    assert [(t.receivers, t.everyone) for t in schedule] == [((1, 2), True), ((2,), False)]
    assert (
        files_written(schedule, 1) == {0}
        and files_written(schedule, 2) == {0, 1}
        and files_written(schedule, 0) == {0, 1}
    )


@st.composite
def schedules(draw: st.DrawFn) -> tuple[Plan, list[int], int, int, list[int], bool, bool, int | None]:
    """A plan over random files (many small, some large), a slot size, a leader map, receivers."""
    small = st.integers(0, 3 * DIRECT_MIN)
    sizes = draw(st.lists(st.one_of(st.just(0), small, st.integers(1, 1 << 22)), max_size=40))
    nranks = draw(st.integers(1, 12))
    shard_size = max(draw(st.integers(1, 1 << 22)), sum(sizes) // 400 + 1)
    plan = make_plan(sizes, range(len(sizes)), nranks, shard_size)
    slot = max(draw(st.integers(1, 1 << 21)), sum(sizes) // 1500 + 1)
    groups = draw(st.integers(1, nranks))
    root_of = [r % groups for r in range(nranks)]
    tapered = draw(st.one_of(st.none(), st.integers(1, 1 << 20)))
    return plan, sizes, slot, groups, root_of, draw(st.booleans()), draw(st.booleans()), tapered


def _subset(file: int, root: int, groups: int) -> tuple[int, ...]:
    return tuple(r for r in range(groups) if (file + r) % 2 == 0 or r == (root + 1) % groups)


@given(schedules())
@settings(max_examples=300, deadline=None)
def test_schedule_properties(args: tuple[Plan, list[int], int, int, list[int], bool, bool, int | None]) -> None:
    plan, sizes, slot, groups, root_of, pack, subset, tapered = args
    receivers_of = (lambda f, r: _subset(f, r, groups)) if subset else None
    schedule = transfer_schedule(
        plan, slot, groups, root_of=root_of, receivers_of=receivers_of, pack=pack, tapered=tapered
    )
    transfers = list(schedule)  # each Transfer made once (the schedule makes them as read)
    assert [t.seq for t in transfers] == list(range(len(schedule)))
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    # Per file, its extents in schedule order: (offset, root, transfer).
    extents_of: dict[int, list[tuple[int, int, Transfer]]] = defaultdict(list)
    for t in transfers:
        assert t.extents and 0 < t.length <= slot  # no slot overflows
        assert 0 <= t.root < groups and t.root not in t.receivers
        assert list(t.receivers) == sorted(set(t.receivers))
        assert t.everyone == (len(t.receivers) == groups - 1)
        spans = sorted((e.at, e.at + e.length) for e in t.extents)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # extents never overlap in the slot
        assert len(t.extents) <= MAX_EXTENTS
        for e in t.extents:
            assert e.length > 0
            covered[e.file].append((e.offset, e.length))
            extents_of[e.file].append((e.offset, t.root, t))
            if e.length >= DIRECT_MIN and e.offset % ALIGN == 0:
                assert e.at % ALIGN == 0 and e.direct  # O_DIRECT-capable extents stay aligned
            want = _subset(e.file, t.root, groups) if subset else tuple(range(groups))
            assert t.receivers == tuple(sorted(set(want) - {t.root}))  # every receiver gets what it needs
    # Every byte of every file is in exactly one transfer, from its shard's owner's leader.
    for index, size in enumerate(sizes):
        pieces = sorted(covered.get(index, []))
        position = 0
        for offset, length in pieces:
            assert offset == position
            position += length
        assert position == size
    starts = {f: sorted((s.offset, i) for i, s in enumerate(plan.shards) if s.file == f) for f in extents_of}
    inside: dict[int, set[int]] = defaultdict(set)  # shard -> the roots of the extents starting in it
    for file, extents in extents_of.items():
        for offset, root, _ in extents:
            # The last shard of the file that starts at or before the extent.
            k = bisect.bisect_right(starts[file], (offset, len(plan.shards))) - 1
            if k >= 0:
                shard = plan.shards[starts[file][k][1]]
                if offset < shard.offset + shard.length:
                    inside[starts[file][k][1]].add(root)
    for i, shard in enumerate(plan.shards):
        assert inside[i] == {root_of[shard.owner]}
    # Each root's pieces keep plan order (its downloads land in that order).
    by_root: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for t in transfers:
        by_root[t.root].extend((e.file, e.offset) for e in t.extents)
    for pieces_of_root in by_root.values():
        assert pieces_of_root == sorted(pieces_of_root)
    # last_of_file: exactly the last extent of each file from each root, in schedule order.
    last: dict[tuple[int, int], tuple[int, int]] = {}
    for t in transfers:
        for i, e in enumerate(t.extents):
            last[(t.root, e.file)] = (t.seq, i)
    flagged = {(t.seq, i) for t in transfers for i, e in enumerate(t.extents) if e.last_of_file}
    assert flagged == set(last.values())
    # files_written and streamed_files against a direct reading of the schedule.
    for rank in range(groups):
        mine = [t for t in transfers if t.root == rank or rank in t.receivers]
        assert files_written(schedule, rank) == {e.file for t in mine for e in t.extents}
        streamed = streamed_files(schedule, rank, sizes)
        for index in streamed:
            offsets = [offset for offset, _, _ in extents_of[index]]
            assert all(t.involves(rank) for _, _, t in extents_of[index])
            assert offsets == sorted(offsets)
    if groups == 1 or not subset:
        # One copy per rank, every rank in every transfer: files come in offset order when
        # their shards share a root.
        owners: dict[int, set[int]] = defaultdict(set)
        for shard in plan.shards:
            owners[shard.file].add(shard.owner)
        single = {file for file, who in owners.items() if len(who) == 1}
        for rank in range(groups):
            assert single <= streamed_files(schedule, rank, sizes)


def test_halves_cut_what_is_left_in_two_down_to_the_smallest() -> None:
    assert halves(4 << 20, 1 << 20) == [2 << 20, 1 << 20, 1 << 20]
    assert halves(3 << 20, 1 << 20) == [1 << 20, 1 << 20, 1 << 20]
    assert halves(1 << 20, 1 << 20) == [1 << 20]
    assert halves((1 << 20) + 5, 1 << 20) == [(1 << 20) + 5]  # half is under the smallest: kept whole
    assert halves(10, 1) == [5, 2, 1, 1, 1]


@given(st.integers(1, 1 << 30), st.integers(1, 1 << 22))
def test_halves_tile_the_length_in_multiples_of_the_smallest_with_a_short_last(length: int, smallest: int) -> None:
    cut = halves(length, smallest)
    assert sum(cut) == length and all(c > 0 for c in cut)
    assert all(c % smallest == 0 for c in cut[:-1])
    assert all(a >= b for a, b in itertools.pairwise(cut[:-1]))  # shrinking, then the rest
    if len(cut) > 1:
        assert cut[-1] <= 2 * smallest


def test_a_tapered_schedule_sends_each_roots_last_piece_in_halves_each_its_own_transfer() -> None:
    # Two roots, 16 MiB each, 4 MiB slots: each root's last 4 MiB go as 2, 1 and 1 MiB.
    MiB = 1 << 20
    plan = make_plan([16 * MiB, 16 * MiB], [0, 1], 2, 16 * MiB)
    plain = transfer_schedule(plan, 4 * MiB, 2)
    schedule = transfer_schedule(plan, 4 * MiB, 2, tapered=MiB)
    assert [t.length for t in plain] == [4 * MiB] * 8
    lengths = {root: [t.length for t in schedule if t.root == root] for root in (0, 1)}
    assert lengths == {0: [4 * MiB] * 3 + [2 * MiB, MiB, MiB], 1: [4 * MiB] * 3 + [2 * MiB, MiB, MiB]}
    assert [t.root for t in schedule][-2:] == [0, 1]  # the smallest leave last
    assert sum(1 for t in schedule for e in t.extents if e.last_of_file) == 2


def test_packing_is_tight() -> None:
    """With one root, a transfer closes only when the next piece cannot fit."""
    rng = random.Random(5)
    sizes = [rng.randrange(0, 20_000) for _ in range(3000)]
    plan = make_plan(sizes, range(len(sizes)), 1, 1 << 30)
    slot = 1 << 20
    schedule = transfer_schedule(plan, slot, 2)
    assert sum(t.length for t in schedule) == sum(sizes)  # small files: no padding at all
    for t, following in itertools.pairwise(schedule):
        assert t.length + following.extents[0].length > slot or len(t.extents) == MAX_EXTENTS
    assert len(schedule) <= sum(sizes) // slot + 2


def test_landing_order_interleaves_roots() -> None:
    """Two roots downloading at the same pace: their transfers alternate, each root's in order."""
    plan = Plan(shards=(Shard(0, 0, 40, 0), Shard(1, 0, 40, 1)), nranks=2)
    assert [t.root for t in transfer_schedule(plan, 10, 2)] == [0, 1] * 4


@st.composite
def landings(draw: st.DrawFn) -> tuple[list[Transfer], list[tuple[int, int, int]], list[int]]:
    plan, _, slot, groups, root_of, pack, _, tapered = draw(schedules())
    schedule = transfer_schedule(plan, slot, groups, root_of=root_of, pack=pack, tapered=tapered)
    # Blocks of at least 1/400 of root 0's bytes: a few hundred blocks say as much as thousands,
    # whose permutations and checks took a run of this test up to 25 s.
    mine = sum(shard.length for shard in plan.shards if root_of[shard.owner] == 0)
    block = draw(st.integers(max(1, mine // 400), max(1, mine // 400, 1 << 21)))
    blocks = []
    for shard in plan.shards:
        if root_of[shard.owner] != 0:
            continue
        for offset in range(shard.offset, shard.offset + shard.length, block):
            blocks.append((shard.file, offset, min(block, shard.offset + shard.length - offset)))
    order = draw(st.permutations(range(len(blocks))))
    return schedule, blocks, list(order)


@given(landings())
@settings(max_examples=200, deadline=None)
def test_landing_readiness(args: tuple[list[Transfer], list[tuple[int, int, int]], list[int]]) -> None:
    """A transfer is ready exactly when every block overlapping its extents has landed, once."""
    schedule, blocks, order = args
    landing = Landing(schedule, 0, blocks)
    mine = {t.seq for t in schedule if t.root == 0}
    assert set(landing.waits) == mine
    assert landing.ready() == []  # every transfer of root 0 has downloaded bytes
    by_file: dict[int, list[tuple[int, int, int]]] = {}  # file -> (offset, end, block), by offset
    for b, (file, offset, length) in enumerate(blocks):
        by_file.setdefault(file, []).append((offset, offset + length, b))
    for spans in by_file.values():
        spans.sort()
    overlapping: dict[int, set[int]] = {seq: set() for seq in mine}  # the blocks each transfer needs
    for seq in mine:
        for extent in schedule[seq].extents:
            spans = by_file.get(extent.file, [])
            # The blocks do not overlap each other: the first that ends past the extent's start, on.
            i = bisect.bisect_right([end for _, end, _ in spans], extent.offset)
            while i < len(spans) and spans[i][0] < extent.offset + extent.length:
                overlapping[seq].add(spans[i][2])
                i += 1
    arrived: set[int] = set()
    ready: list[int] = []
    for index in order:
        arrived.add(index)
        for seq in landing.landed(index):
            assert overlapping[seq] <= arrived, (seq, overlapping[seq] - arrived)
            ready.append(seq)
    assert sorted(ready) == sorted(mine)
    download = Landing(schedule, 0, blocks).order()
    assert sorted(download) == list(range(len(blocks)))


def test_landing_download_order_follows_the_schedule() -> None:
    plan = Plan(shards=(Shard(0, 0, 40, 0), Shard(1, 0, 40, 0)), nranks=1)
    schedule = transfer_schedule(plan, 20, 2)
    blocks = [(1, 20, 20), (1, 0, 20), (0, 20, 20), (0, 0, 20)]
    assert Landing(schedule, 0, blocks).order() == [3, 2, 1, 0]
    assert Landing(schedule, 1, blocks).waits == {}


def test_call_slices_examples() -> None:
    assert list(call_slices(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    assert list(call_slices(8, 4)) == [(0, 4), (4, 8)]
    assert list(call_slices(3, 4)) == [(0, 3)]
    assert list(call_slices(0, 4)) == []


def test_max_call_bytes_fits_a_c_int() -> None:
    assert MAX_CALL_BYTES < 2**31


@pytest.mark.parametrize("limit", [0, -5])
def test_call_slices_rejects_bad_limit(limit: int) -> None:
    with pytest.raises(ValueError):
        list(call_slices(10, limit))


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 32))
def test_call_slices_cover_the_length(length: int, limit: int) -> None:
    slices = list(call_slices(length, limit)) if length // limit < 10_000 else []
    if not slices:
        return
    assert slices[0][0] == 0 and slices[-1][1] == length
    assert all(b - a <= limit for a, b in slices)
    assert all(s[1] == t[0] for s, t in itertools.pairwise(slices))


# ---------------------------------------------------------------------------------------
# The schedule as columns (Transfers): the same answers as the list of its transfers


@given(schedules(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_columns_answer_as_the_list_does(
    args: tuple[Plan, list[int], int, int, list[int], bool, bool, int | None], subset: bool
) -> None:
    plan, sizes, slot, groups, root_of, pack, _, tapered = args
    receivers_of = (lambda f, r: _subset(f, r, groups)) if subset else None
    columns = transfer_schedule(
        plan, slot, groups, root_of=root_of, receivers_of=receivers_of, pack=pack, tapered=tapered
    )
    listed = list(columns)
    assert isinstance(columns, Transfers) and columns == listed and listed == columns
    assert Transfers.of(listed, groups) == listed
    assert completions(columns) == completions(listed)
    assert max_length(columns) == max_length(listed) == max((t.length for t in listed), default=0)
    assert payload(columns) == payload(listed) and files_of(columns) == files_of(listed)
    for rank in range(groups):
        assert involving(columns, rank).tolist() == involving(listed, rank).tolist()
        assert files_written(columns, rank) == files_written(listed, rank)
        assert streamed_files(columns, rank, sizes) == streamed_files(listed, rank, sizes)
        blocks = [(s.file, s.offset, s.length) for s in plan.shards if root_of[s.owner] == rank]
        from_columns, from_list = Landing(columns, rank, blocks), Landing(listed, rank, blocks)
        assert (from_columns.waits, from_columns.feeds) == (from_list.waits, from_list.feeds)


def test_transfers_index_slice_and_iterate_like_a_list() -> None:
    sizes = [100, 200, DIRECT_MIN + 5, 7, 3 * DIRECT_MIN, 0, 50]
    plan = make_plan(sizes, range(len(sizes)), 3, DIRECT_MIN)
    columns = transfer_schedule(plan, DIRECT_MIN, 3)
    listed = list(columns)
    assert len(listed) == len(columns) > 3
    assert [columns[i] for i in range(-len(columns), len(columns))] == listed + listed
    for cut in (slice(None), slice(1, -1), slice(None, None, 2), slice(5, 1, -1), slice(100, 200)):
        assert columns[cut] == listed[cut]
    assert transfers_at(columns, [3, 0]) == [listed[3], listed[0]] == transfers_at(listed, [3, 0])
    for bad in (len(columns), -len(columns) - 1):
        with pytest.raises(IndexError):
            columns[bad]
    assert columns != listed[:-1] and columns != listed[::-1]
    assert transfer_schedule(Plan(shards=(), nranks=2), 8, 2) == []


def test_transfers_columns_are_read_only() -> None:
    plan = make_plan([10, 20], range(2), 2, 1 << 20)
    columns = transfer_schedule(plan, 1 << 20, 2)
    with pytest.raises(ValueError):
        columns.extents.length[0] = 1
    with pytest.raises(ValueError):
        columns.roots[0] = 1


def test_transfers_of_needs_seqs_in_order() -> None:
    extent = Extent(0, 0, 1, 0, True)
    with pytest.raises(ValueError):
        Transfers.of([Transfer(1, 0, (1,), (extent,), True)], 2)


def test_transfers_asked_one_by_one_past_what_is_kept() -> None:
    """Thousands of transfers asked for in order, and back: those kept near each other are
    dropped as more are made, and every answer is still the transfer at that place."""
    plan = make_plan([3] * 12_000, range(12_000), 4, 1 << 20)
    columns = transfer_schedule(plan, 1 << 20, 4, pack=False)
    listed = list(columns)
    assert len(listed) == 12_000
    assert [columns[i] for i in range(len(columns))] == listed
    assert [columns[i] for i in reversed(range(len(columns)))] == listed[::-1]
