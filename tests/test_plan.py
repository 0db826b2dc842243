"""Unit and property tests for the LPT planner and ``split_ranges`` (azcp_cluster/core/plan.py)."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.plan import (
    BALANCED_MIN_SHARD,
    SHARD_ALIGN,
    Plan,
    Shard,
    balanced_shard_size,
    make_plan,
    plan_transfers,
    round_up,
    split_ranges,
)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# ---------------------------------------------------------------------------------------
# Helpers


def assert_tiles(ranges: Sequence[tuple[int, int]], size: int) -> None:
    """``ranges`` (sorted by offset) cover ``[0, size)`` exactly: no gap, no overlap, no empty piece."""
    expected_offset = 0
    for offset, length in ranges:
        assert offset == expected_offset, f"gap or overlap at {offset} (expected {expected_offset})"
        assert length > 0, "empty range"
        expected_offset += length
    assert expected_offset == size


def shards_by_file(plan: Plan) -> dict[int, list[Shard]]:
    grouped: dict[int, list[Shard]] = defaultdict(list)
    for shard in plan.shards:
        grouped[shard.file].append(shard)
    return grouped


def assert_plan_valid(plan: Plan, sizes: Sequence[int], files: Sequence[int], owners: Sequence[int]) -> None:
    """Every byte of every planned file is assigned exactly once, to an allowed owner."""
    assert list(plan.shards) == sorted(plan.shards, key=lambda s: (s.file, s.offset)), "not in broadcast order"
    grouped = shards_by_file(plan)
    assert set(grouped) == {f for f in files if sizes[f] > 0}, "planned files differ from the non-empty input"
    for index, shards in grouped.items():
        assert_tiles([(s.offset, s.length) for s in shards], sizes[index])
    allowed = set(owners)
    assert all(s.owner in allowed for s in plan.shards)
    assert sum(plan.loads()) == sum(sizes[f] for f in files)
    assert len(plan.loads()) == plan.nranks


# ---------------------------------------------------------------------------------------
# round_up / split_ranges


@given(st.integers(0, 1 << 50), st.integers(1, 1 << 20))
@settings(max_examples=200)
def test_round_up_is_smallest_multiple_at_or_above(value: int, align: int) -> None:
    up = round_up(value, align)
    assert up % align == 0
    assert value <= up < value + align


def test_split_ranges_examples() -> None:
    assert split_ranges(0, GiB) == []
    assert split_ranges(-5, GiB) == []
    assert split_ranges(1, GiB) == [(0, 1)]
    assert split_ranges(GiB, GiB) == [(0, GiB)]
    assert split_ranges(10 * GiB, GiB) == [(i * GiB, GiB) for i in range(10)]
    # 2 GiB + 1 byte: three near-equal, 4 KiB-aligned pieces, the last one shorter.
    ranges = split_ranges(2 * GiB + 1, GiB)
    assert len(ranges) == 3
    assert [o % SHARD_ALIGN for o, _ in ranges] == [0, 0, 0]
    assert ranges[0][1] == ranges[1][1] == round_up(-(-(2 * GiB + 1) // 3), SHARD_ALIGN)
    assert_tiles(ranges, 2 * GiB + 1)


def test_split_ranges_pieces_are_near_equal_not_greedy() -> None:
    # A greedy split of 4.3 GiB at 1 GiB would leave a 0.3 GiB runt; the planner wants 5 similar pieces.
    size = int(4.3 * GiB)
    lengths = [length for _, length in split_ranges(size, GiB)]
    assert len(lengths) == 5
    assert max(lengths) - min(lengths) <= SHARD_ALIGN * 5


@given(size=st.integers(-10, 1 << 42), shard_size=st.integers(1, 1 << 32))
@settings(max_examples=400)
def test_split_ranges_tiles_the_file(size: int, shard_size: int) -> None:
    # Keep the piece count bounded so a tiny shard size on a huge file stays fast.
    if size > 0 and size // shard_size > 4_000:
        size = shard_size * 4_000 + size % shard_size
    ranges = split_ranges(size, shard_size)
    if size <= 0:
        assert ranges == []
        return
    assert_tiles(ranges, size)
    lengths = [length for _, length in ranges]
    # Never more pieces than a plain split at shard_size, each at most ~shard_size.
    assert len(ranges) <= -(-size // shard_size)
    assert max(lengths) <= round_up(shard_size, SHARD_ALIGN)
    # Near-equal: every piece but the last has the same length, the last is not longer.
    assert len(set(lengths[:-1])) <= 1
    assert lengths[-1] <= lengths[0]
    if size <= shard_size:
        assert ranges == [(0, size)]


@given(size=st.integers(1, 1 << 42), shard_size=st.integers(2 * SHARD_ALIGN, 1 << 32))
@settings(max_examples=300)
def test_split_ranges_boundaries_are_aligned(size: int, shard_size: int) -> None:
    """With shard_size >= 2 * SHARD_ALIGN every piece is >= SHARD_ALIGN, so every boundary is aligned."""
    if size // shard_size > 4_000:
        size = shard_size * 4_000 + size % shard_size
    for offset, _ in split_ranges(size, shard_size):
        assert offset % SHARD_ALIGN == 0


@given(
    size=st.integers(1, 1 << 30),
    shard_size=st.integers(1, 1 << 24),
    align=st.sampled_from([1, 512, 4096, 65536]),
)
@settings(max_examples=200)
def test_split_ranges_custom_align(size: int, shard_size: int, align: int) -> None:
    if size // shard_size > 2_000:
        size = shard_size * 2_000 + size % shard_size
    ranges = split_ranges(size, shard_size, align)
    assert_tiles(ranges, size)
    if ranges[0][1] >= align:
        assert all(offset % align == 0 for offset, _ in ranges)


# ---------------------------------------------------------------------------------------
# make_plan: examples


def test_make_plan_examples_lpt_and_ties() -> None:
    # Largest first onto the least-loaded rank, ties to the lowest rank.
    plan = make_plan([3, 3, 2, 2, 2], range(5), nranks=2, shard_size=GiB)
    assert [(s.file, s.owner) for s in plan.shards] == [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0)]
    assert plan.loads() == [7, 5]
    assert plan.owned_by(1) == [Shard(1, 0, 3, 1), Shard(3, 0, 2, 1)]
    assert plan.owned_by(0) == [s for s in plan.shards if s.owner == 0]
    # Equal pieces: file order breaks ties, lowest rank first.
    plan = make_plan([5, 5, 5], [2, 0, 1], nranks=4, shard_size=GiB)
    assert [(s.file, s.owner) for s in plan.shards] == [(0, 0), (1, 1), (2, 2)]
    assert plan.loads() == [5, 5, 5, 0]


def test_make_plan_splits_big_files_across_ranks() -> None:
    plan = make_plan([4 * GiB], [0], nranks=4, shard_size=GiB)
    assert [(s.offset, s.length, s.owner) for s in plan.shards] == [(i * GiB, GiB, i) for i in range(4)]
    assert plan.spread() == 0.0


def test_make_plan_skips_files_not_listed_and_empty_files() -> None:
    sizes = [10, 0, 20, 30]
    plan = make_plan(sizes, [1, 2], nranks=3, shard_size=GiB)
    assert plan.shards == (Shard(file=2, offset=0, length=20, owner=0),)
    assert make_plan(sizes, [], nranks=3, shard_size=GiB).shards == ()


def test_make_plan_owners_subset() -> None:
    plan = make_plan([100] * 6, range(6), nranks=8, shard_size=GiB, owners=[5, 3, 3])
    assert {s.owner for s in plan.shards} == {3, 5}
    assert plan.loads()[3] == plan.loads()[5] == 300
    assert plan.spread(owners=[3, 5]) == 0.0
    assert plan.spread() > 0  # over all 8 ranks, six of them idle


@pytest.mark.parametrize(
    ("nranks", "owners"),
    [(0, None), (-1, None), (4, []), (4, [4]), (4, [-1, 0]), (1, [0, 1]), (4, [1, 9, 2]), (4, [1, -1, 2])],
)
def test_make_plan_rejects_bad_ranks(nranks: int, owners: list[int] | None) -> None:
    with pytest.raises(ValueError):
        make_plan([1, 2, 3], range(3), nranks=nranks, shard_size=GiB, owners=owners)


def test_spread_examples() -> None:
    plan = Plan(shards=(Shard(0, 0, 3, 0), Shard(1, 0, 1, 1)), nranks=2)
    assert plan.loads() == [3, 1]
    assert plan.spread() == pytest.approx(0.5)
    assert plan.spread(owners=[0]) == 0.0
    assert plan.spread(owners=[]) == 0.0
    assert Plan(shards=(), nranks=3).spread() == 0.0


# ---------------------------------------------------------------------------------------
# make_plan: properties

size_lists = st.lists(
    st.one_of(st.just(0), st.integers(1, 4 * KiB), st.integers(1, 64 * MiB), st.integers(1, 6 * GiB)),
    min_size=0,
    max_size=40,
)
shard_sizes = st.one_of(st.integers(1, 16 * KiB), st.integers(64 * KiB, 2 * GiB))


@st.composite
def plan_inputs(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, list[int]]:
    sizes = draw(size_lists)
    files = draw(st.lists(st.integers(0, len(sizes) - 1), unique=True)) if sizes else []
    nranks = draw(st.integers(1, 64))
    shard_size = draw(shard_sizes)
    # Keep the number of pieces bounded so small shard sizes stay fast.
    total = sum(sizes[f] for f in files)
    if total // shard_size > 2_000:
        shard_size = total // 2_000 + 1
    owners = draw(st.one_of(st.none(), st.lists(st.integers(0, nranks - 1), min_size=1, max_size=nranks)))
    return sizes, files, nranks, shard_size, (list(range(nranks)) if owners is None else owners)


@given(plan_inputs())
@settings(max_examples=150, deadline=None)
def test_every_byte_assigned_exactly_once(args: tuple[list[int], list[int], int, int, list[int]]) -> None:
    sizes, files, nranks, shard_size, owners = args
    plan = make_plan(sizes, files, nranks, shard_size, owners=owners)
    assert plan.nranks == nranks
    assert_plan_valid(plan, sizes, files, owners)
    # Each shard is one of split_ranges' pieces of its file.
    for index, shards in shards_by_file(plan).items():
        assert [(s.offset, s.length) for s in shards] == split_ranges(sizes[index], shard_size)


@given(plan_inputs(), st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_plan_is_deterministic_and_order_independent(
    args: tuple[list[int], list[int], int, int, list[int]], rnd: random.Random
) -> None:
    sizes, files, nranks, shard_size, owners = args
    plan = make_plan(sizes, files, nranks, shard_size, owners=owners)
    assert make_plan(list(sizes), list(files), nranks, shard_size, owners=list(owners)) == plan
    shuffled_files = list(files)
    rnd.shuffle(shuffled_files)
    shuffled_owners = list(owners)
    rnd.shuffle(shuffled_owners)
    assert make_plan(sizes, shuffled_files, nranks, shard_size, owners=shuffled_owners) == plan


@given(plan_inputs())
@settings(max_examples=150, deadline=None)
def test_lpt_bound(args: tuple[list[int], list[int], int, int, list[int]]) -> None:
    """max load <= mean + largest piece, the mean taken over the allowed owners."""
    sizes, files, nranks, shard_size, owners = args
    plan = make_plan(sizes, files, nranks, shard_size, owners=owners)
    if not plan.shards:
        return
    allowed = sorted(set(owners))
    loads = plan.loads()
    chosen = [loads[r] for r in allowed]
    largest = max(s.length for s in plan.shards)
    assert max(chosen) * len(chosen) <= sum(chosen) + largest * len(chosen)
    # Owners outside the subset get nothing.
    assert all(loads[r] == 0 for r in range(nranks) if r not in allowed)
    # The least-loaded rank never holds more than the mean (sanity of the bookkeeping).
    assert min(chosen) * len(chosen) <= sum(chosen)


@given(
    st.lists(st.integers(1, 10 * GiB), min_size=1, max_size=30),
    st.integers(1, 64),
    st.integers(2 * SHARD_ALIGN, 2 * GiB),
)
@settings(max_examples=100, deadline=None)
def test_plan_shard_boundaries_aligned(sizes: list[int], nranks: int, shard_size: int) -> None:
    if sum(sizes) // shard_size > 2_000:
        shard_size = sum(sizes) // 2_000 + 2 * SHARD_ALIGN
    plan = make_plan(sizes, range(len(sizes)), nranks, shard_size)
    assert all(s.offset % SHARD_ALIGN == 0 for s in plan.shards)


# ---------------------------------------------------------------------------------------
# Balance on a model-checkpoint-like mix


def checkpoint_mix(seed: int, n_big: int, big_size: float) -> list[int]:
    """``n_big`` safetensors-like shards of ~``big_size`` (+-8% jitter) plus small json/txt files."""
    rng = random.Random(seed)
    sizes = [int(big_size * rng.uniform(0.92, 1.08)) for _ in range(n_big)]
    sizes += [rng.randint(200, 300 * KiB) for _ in range(500 - n_big)]  # configs, tokenizers, READMEs
    sizes += [0, 0]  # a few empty marker-ish files
    rng.shuffle(sizes)
    return sizes


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("n_big", "big_size"),
    [
        (160, 4.3 * GiB),  # the brief's file count and size (~690 GiB in all)
        (160, 2.5 * GiB),  # the brief's file count and total (~400 GiB in all)
    ],
)
def test_checkpoint_mix_is_balanced(seed: int, n_big: int, big_size: float) -> None:
    sizes = checkpoint_mix(seed, n_big, big_size)
    plan = make_plan(sizes, range(len(sizes)), nranks=16, shard_size=GiB)
    assert_plan_valid(plan, sizes, range(len(sizes)), range(16))
    assert plan.spread() < 0.02, f"spread {plan.spread():.4f} with loads {plan.loads()}"


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=50_000), min_size=1, max_size=30),
    nranks=st.integers(min_value=1, max_value=6),
    shard=st.integers(min_value=1, max_value=20_000),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_plan_transfers_peers_before_azure(sizes: list[int], nranks: int, shard: int, data: st.DataObject) -> None:
    holders = [
        sorted(data.draw(st.sets(st.integers(min_value=0, max_value=nranks - 1), max_size=nranks))) for _ in sizes
    ]
    plan = plan_transfers(sizes, holders, nranks, shard)
    by_file: dict[int, list[Shard]] = {}
    for s in plan.shards:
        by_file.setdefault(s.file, []).append(s)
    for i, size in enumerate(sizes):
        have = holders[i]
        shards = sorted(by_file.get(i, []), key=lambda s: s.offset)
        if len(have) == nranks or size == 0:
            assert shards == [], "a file every rank has, or an empty one, needs no broadcast"
            continue
        # every byte exactly once
        assert shards[0].offset == 0
        assert all(a.offset + a.length == b.offset for a, b in itertools.pairwise(shards))
        assert shards[-1].offset + shards[-1].length == size
        if have:
            assert all(s.peer and s.owner == min(have) for s in shards), "peer files come from the lowest holder"
        else:
            assert not any(s.peer for s in shards)
    # downloads (loads) count only files no rank has
    assert sum(plan.loads()) == sum(size for size, have in zip(sizes, holders, strict=True) if not have)
    assert plan_transfers(sizes, holders, nranks, shard) == plan


def test_plan_transfers_copies_counts_groups_not_ranks() -> None:
    # 4 ranks in 2 nodes (leaders 0 and 2): a file both leaders hold needs nothing,
    # a file one leader holds comes from it, a file nobody holds goes to the downloaders.
    holders = [[0, 2], [2], []]
    plan = plan_transfers([10, 10, 10], holders, 4, 100, owners=[0, 1, 2, 3], copies=2)
    assert [(s.file, s.owner, s.peer) for s in plan.shards] == [(1, 2, True), (2, 0, False)]
    # Without copies, two holders out of four ranks would still be "missing somewhere".
    assert {s.file for s in plan_transfers([10, 10, 10], holders, 4, 100).shards} == {0, 1, 2}


@given(
    sizes=st.lists(st.integers(min_value=1, max_value=50_000), min_size=1, max_size=20),
    groups=st.integers(min_value=1, max_value=4),
    per_group=st.integers(min_value=1, max_value=3),
    data=st.data(),
)
@settings(max_examples=100, deadline=None)
def test_plan_transfers_with_groups_downloads_only_on_owners(
    sizes: list[int], groups: int, per_group: int, data: st.DataObject
) -> None:
    nranks = groups * per_group
    leaders = [g * per_group for g in range(groups)]
    holders = [sorted(data.draw(st.sets(st.sampled_from(leaders), max_size=groups))) for _ in sizes]
    owners = sorted(data.draw(st.sets(st.integers(0, nranks - 1), min_size=1)))
    plan = plan_transfers(sizes, holders, nranks, 4096, owners=owners, copies=groups)
    for s in plan.shards:
        if s.peer:
            assert s.owner == min(holders[s.file]) and len(holders[s.file]) < groups
        else:
            assert s.owner in owners and not holders[s.file]
    assert {s.file for s in plan.shards} == {i for i, h in enumerate(holders) if len(h) < groups}


# ---------------------------------------------------------------------------------------
# The plan as columns


@given(plan_inputs(), st.data())
@settings(max_examples=100, deadline=None)
def test_columns_answer_as_the_shards_do(
    args: tuple[list[int], list[int], int, int, list[int]], data: st.DataObject
) -> None:
    sizes, _, nranks, shard_size, owners = args
    shard_size = max(shard_size, sum(sizes) // 2_000 + 1)  # a bounded count of pieces
    holders = [data.draw(st.sets(st.integers(0, nranks - 1), max_size=2)) for _ in sizes]
    plan = plan_transfers(sizes, [sorted(h) for h in holders], nranks, shard_size, owners=owners)
    shards = plan.shards
    assert plan.shard_count == len(shards)
    assert plan == Plan(shards, nranks, plan.receivers)  # from tuples or from columns: one plan
    loads = [0] * nranks
    for s in shards:
        loads[s.owner] += 0 if s.peer else s.length
    assert plan.loads() == loads
    fresh = plan_transfers(sizes, [sorted(h) for h in holders], nranks, shard_size, owners=owners)
    for rank in range(nranks):
        # With the tuples made (``plan``) and without (``fresh``): the same shards.
        want = [Shard(s.file, s.offset, s.length, s.owner) for s in shards if s.owner == rank and not s.peer]
        assert plan.owned_by(rank) == fresh.owned_by(rank) == want
    chosen = data.draw(st.sets(st.integers(0, nranks - 1)))
    assert plan.downloaded_files(chosen) == {s.file for s in shards if s.owner in chosen and not s.peer}
    assert plan.files_per_rank() == [len({s.file for s in shards if s.owner == r}) for r in range(nranks)]


def test_a_plan_is_immutable_and_equal_by_value() -> None:
    plan = make_plan([10, 20, 30], range(3), 2, GiB)
    with pytest.raises(AttributeError):
        plan.nranks = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        plan.columns.owner[0] = 1
    assert plan == make_plan([10, 20, 30], [2, 1, 0], 2, GiB)
    assert plan != make_plan([10, 20, 30], range(3), 3, GiB)
    assert plan != make_plan([10, 20, 31], range(3), 2, GiB)
    assert "3 shards" in repr(plan)
    with pytest.raises(TypeError):
        hash(plan)


MIB = 1024 * 1024


def test_a_few_files_over_more_downloaders_are_cut_finer_so_every_downloader_gets_a_share() -> None:
    # The cluster benchmark's checkpoint: four 32 MiB files over eight downloaders. At 1 GiB
    # shards four download 32 MiB each and four nothing; 8 MiB shards give each two.
    sizes = [32 * MIB] * 4
    coarse = make_plan(sizes, range(4), 8, 1 << 30)
    assert sorted(coarse.loads()) == [0] * 4 + [32 * MIB] * 4
    plan = plan_transfers(sizes, [[] for _ in sizes], 8, 1 << 30)
    assert plan.loads() == [16 * MIB] * 8
    assert {s.length for s in plan.shards} == {BALANCED_MIN_SHARD}


def test_a_balanced_plan_is_left_as_it_is() -> None:
    # Many files, each small against a share: LPT already ends within an eighth of the mean.
    sizes = [3 * MIB + 17 * i for i in range(400)]
    holders: list[list[int]] = [[] for _ in sizes]
    assert plan_transfers(sizes, holders, 8, 1 << 30) == make_plan(sizes, range(400), 8, 1 << 30)
    # One downloader: nothing to share.
    assert plan_transfers([64 * MIB], [[]], 4, 1 << 30, owners=[2]) == make_plan([64 * MIB], [0], 4, 1 << 30, [2])


def test_finer_shards_never_go_under_the_floor_nor_over_the_option() -> None:
    # Two 12 MiB files over 8: the floor (8 MiB) leaves four pieces, still better than two.
    plan = plan_transfers([12 * MIB, 12 * MIB], [[], []], 8, 1 << 30)
    assert min(s.length for s in plan.shards) >= 4 * MIB and max(plan.loads()) == 6 * MIB
    assert balanced_shard_size(make_plan([12 * MIB] * 2, [0, 1], 8, 1 << 30), 8, 1 << 30) == BALANCED_MIN_SHARD
    # A --shard-size already as fine: kept.
    assert balanced_shard_size(make_plan([12 * MIB] * 2, [0, 1], 8, 4 * MIB), 8, 4 * MIB) is None


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=200 * MIB), min_size=1, max_size=12),
    nranks=st.integers(min_value=1, max_value=16),
    shard_mib=st.sampled_from([1, 16, 1024]),
)
def test_a_balanced_plan_covers_every_byte_once_and_its_largest_share_is_never_larger(
    sizes: list[int], nranks: int, shard_mib: int
) -> None:
    holders: list[list[int]] = [[] for _ in sizes]
    plan = plan_transfers(sizes, holders, nranks, shard_mib * MIB)
    plain = make_plan(sizes, range(len(sizes)), nranks, shard_mib * MIB)
    assert max(plan.loads()) <= max(plain.loads())
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for shard in plan.shards:
        assert shard.offset % SHARD_ALIGN == 0
        covered[shard.file].append((shard.offset, shard.length))
    for index, size in enumerate(sizes):
        spans = sorted(covered.get(index, []))
        assert sum(length for _, length in spans) == size
        assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(spans))
