"""The column-wise plan and schedule against main's before them (tests/reference_plan_schedule.py).

Thousands of random plans (sizes from empty to many shards, shard and slot sizes aligned or not,
ranks and owner subsets, holders and copies, resumed segments with their receivers, leaders,
receiver subsets, packing or not) and hand-made plans (any order, empty shards): the same
shards, owners and receivers, the same transfers with the same extents, in the same order.
``AZCP_DIFFERENTIAL_CASES`` sets how many random cases (default 1,500).
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.packing import MAX_EXTENTS, transfer_schedule
from azcp_cluster.core.plan import SHARD_ALIGN, Plan, Shard, lpt_owners, plan_transfers, split_columns, split_ranges
from azcp_cluster.core.schedule import ALIGN, DIRECT_MIN
from tests import reference_plan_schedule as reference

CASES = int(os.environ.get("AZCP_DIFFERENTIAL_CASES", "1500"))
KiB, MiB = 1 << 10, 1 << 20


def random_sizes(rng: random.Random, shard: int, slot: int) -> list[int]:
    """Sizes around every boundary the plan and the schedule have."""
    count = rng.choice([0, 1, 2, 5, 20, 60, 200])
    kinds: list[Callable[[], int]] = [
        lambda: 0,
        lambda: rng.randint(1, 100),
        lambda: rng.randint(1, 3 * DIRECT_MIN),
        lambda: rng.choice([DIRECT_MIN - 1, DIRECT_MIN, ALIGN * rng.randint(16, 40), slot, slot + 1, shard]),
        lambda: rng.randint(1, 3 * slot),
        lambda: rng.randint(1, 4 * shard),
        lambda: shard * rng.randint(1, 5) + rng.choice([0, 1, -1, ALIGN]),
    ]
    weights = [1, 3, 4, 2, 3, 2, 1]
    return [max(0, rng.choices(kinds, weights)[0]()) for _ in range(count)]


def random_segments(rng: random.Random, size: int, nranks: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """A file's resumed segments: aligned cuts, each held by some ranks (or none)."""
    cuts = sorted({0, size, *(rng.randrange(0, size + 1) // ALIGN * ALIGN for _ in range(rng.randint(0, 4)))})
    segments = []
    for start, end in itertools.pairwise(cuts):
        if end > start:
            holders = tuple(sorted(rng.sample(range(nranks), rng.randint(0, min(nranks, 3)))))
            segments.append((start, end - start, holders))
    return segments


def random_case(seed: int) -> dict[str, Any]:
    """One random input to plan_transfers and transfer_schedule."""
    rng = random.Random(seed)
    shard = rng.choice([rng.randint(1, 16 * KiB), ALIGN * rng.randint(1, 64), rng.randint(64 * KiB, 4 * MiB)])
    slot = rng.choice([rng.randint(1, 8 * KiB), ALIGN * rng.randint(1, 256), rng.randint(64 * KiB, 8 * MiB)])
    if rng.random() < 0.1:  # many tiny files on few ranks: slots full of extents
        sizes = [rng.randint(0, 300) for _ in range(rng.randint(1000, 2600))]
        slot = max(slot, 1 << 22)
    else:
        sizes = random_sizes(rng, shard, slot)
    total = sum(sizes)
    shard = max(shard, total // 3000 + 1)
    slot = max(slot, total // 6000 + 1)
    nranks = rng.randint(1, 40)
    groups = rng.randint(1, nranks)
    per_group = -(-nranks // groups)
    root_of = [r // per_group for r in range(nranks)] if rng.random() < 0.5 else [r % groups for r in range(nranks)]
    groups = max(root_of) + 1
    leaders = sorted({min(r for r in range(nranks) if root_of[r] == g) for g in range(groups)})
    owners = None if rng.random() < 0.5 else rng.sample(range(nranks), rng.randint(1, nranks))
    copies = None if rng.random() < 0.5 else groups
    holders: list[tuple[int, ...]] = []
    partial: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
    for index, size in enumerate(sizes):
        roll = rng.random()
        pool = leaders if copies is not None else list(range(nranks))
        if roll < 0.15:
            holders.append(tuple(sorted(rng.sample(pool, rng.randint(1, len(pool))))))
        else:
            holders.append(())
            if roll > 0.9 and size > 0:
                partial[index] = random_segments(rng, size, nranks)
    return {
        "sizes": sizes,
        "holders": holders,
        "nranks": nranks,
        "shard": shard,
        "owners": owners,
        "copies": copies,
        "partial": partial or None,
        "receivers": leaders if rng.random() < 0.7 else None,
        "slot": slot,
        "groups": groups,
        "root_of": root_of if rng.random() < 0.8 else None,
        "subset": rng.random() < 0.15,
        "pack": rng.random() < 0.85,
    }


def as_tuples(schedule: Sequence[Any]) -> list[tuple[Any, ...]]:
    """A schedule's transfers as plain tuples (main's are dataclasses, the tool's named tuples)."""
    return [(t.seq, t.root, tuple(t.receivers), tuple(map(tuple, t.extents)), t.everyone) for t in schedule]


def subset_of(groups: int) -> Callable[[int, int], tuple[int, ...]]:
    return lambda file, root: tuple(r for r in range(groups) if (file + r) % 2 == 0 or r == (root + 1) % groups)


def check_case(case: dict[str, Any]) -> None:
    args = (case["sizes"], case["holders"], case["nranks"], case["shard"])
    more = {k: case[k] for k in ("owners", "copies", "partial", "receivers")}
    old = reference.plan_transfers(*args, **more)
    new = plan_transfers(*args, **more)
    assert new.shards == old.shards
    assert dict(new.receivers) == dict(old.receivers)
    assert new.nranks == old.nranks
    assert new.loads() == old.loads()
    assert new.spread() == old.spread()
    for rank in range(case["nranks"]):
        assert new.owned_by(rank) == old.owned_by(rank)
    root_of = case["root_of"]
    ranks = case["groups"] if root_of is not None else case["nranks"]
    receivers_of = subset_of(ranks) if case["subset"] else None
    options = {"root_of": root_of, "receivers_of": receivers_of, "pack": case["pack"]}
    expected = reference.transfer_schedule(old, case["slot"], ranks, **options)
    assert as_tuples(transfer_schedule(new, case["slot"], ranks, **options)) == as_tuples(expected)


# One block of cases in the default suite, the other nine in the slow tier (CI runs both).
@pytest.mark.parametrize("block", [0, *(pytest.param(b, marks=pytest.mark.slow) for b in range(1, 10))])
def test_random_plans_and_schedules_match_main(block: int) -> None:
    for seed in range(block, CASES, 10):
        try:
            check_case(random_case(seed))
        except AssertionError as exc:
            raise AssertionError(f"differs from main's for random_case({seed})") from exc


def test_a_large_mix_matches_main() -> None:
    """20,000 files of every size on 256 ranks: a plan of many pieces, ties, and packed slots."""
    rng = random.Random(23)
    sizes = [rng.choice([rng.randrange(0, 64 * KiB), rng.randrange(1 * MiB, 64 * MiB), 1000]) for _ in range(20_000)]
    sizes[::997] = [rng.randrange(1 << 30, 3 << 30) for _ in sizes[::997]]
    holders = [()] * len(sizes)
    old = reference.plan_transfers(sizes, holders, 256, 1 << 30)
    new = plan_transfers(sizes, holders, 256, 1 << 30)
    assert new.shards == old.shards
    for ranks, root_of in ((256, None), (32, [r // 8 for r in range(256)])):
        expected = reference.transfer_schedule(old, 64 * MiB, ranks, root_of=root_of)
        assert as_tuples(transfer_schedule(new, 64 * MiB, ranks, root_of=root_of)) == as_tuples(expected)


@st.composite
def hand_made_plans(draw: st.DrawFn) -> tuple[list[Shard], int, dict[tuple[int, int], tuple[int, ...]]]:
    """Shards in any order, some empty, some at offsets off the alignment, some named for a
    subset of receivers."""
    nranks = draw(st.integers(1, 6))
    shards = draw(
        st.lists(
            st.builds(
                Shard,
                st.integers(0, 8),
                st.one_of(st.integers(0, 6).map(lambda k: k * ALIGN), st.integers(0, 3 * ALIGN)),
                st.one_of(st.just(0), st.integers(1, 3 * DIRECT_MIN), st.integers(1, 5 * DIRECT_MIN)),
                st.integers(0, nranks - 1),
                st.booleans(),
            ),
            max_size=30,
        )
    )
    named = {
        (s.file, s.offset): tuple(sorted(draw(st.sets(st.integers(0, nranks - 1), max_size=nranks))))
        for s in shards
        if draw(st.integers(0, 4)) == 0
    }
    return shards, nranks, named


@pytest.mark.slow  # about 10 s of 300 examples: CI's slow step runs it (.ci/run)
@given(hand_made_plans(), st.integers(1, 4 * DIRECT_MIN), st.booleans(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_hand_made_plans_schedule_as_main(
    made: tuple[list[Shard], int, dict[tuple[int, int], tuple[int, ...]]], slot: int, pack: bool, leaders: bool
) -> None:
    shards, nranks, named = made
    slot = max(slot, sum(s.length for s in shards) // 3000 + 1)  # a bounded count of pieces
    old = reference.Plan(shards=tuple(shards), nranks=nranks, receivers=named)
    new = Plan(shards, nranks, named)
    assert new.shards == old.shards and new.loads() == old.loads()
    root_of = [r // 2 for r in range(nranks)] if leaders else None
    ranks = (nranks + 1) // 2 if leaders else nranks
    expected = reference.transfer_schedule(old, slot, ranks, root_of=root_of, pack=pack)
    assert as_tuples(transfer_schedule(new, slot, ranks, root_of=root_of, pack=pack)) == as_tuples(expected)


@given(st.lists(st.integers(-5, 1 << 42), max_size=30), st.integers(1, 1 << 32), st.sampled_from([1, 512, SHARD_ALIGN]))
@settings(max_examples=300, deadline=None)
def test_split_columns_is_split_ranges(sizes: list[int], shard_size: int, align: int) -> None:
    sizes = [min(size, shard_size * 300 + size % shard_size) for size in sizes]  # a bounded count of pieces
    starts = [i * SHARD_ALIGN for i in range(len(sizes))]
    file, offset, length, count = split_columns(
        np.arange(len(sizes), dtype=np.int64), np.array(starts, dtype=np.int64), np.array(sizes), shard_size, align
    )
    expected = [
        (i, start + o, n)
        for i, (start, size) in enumerate(zip(starts, sizes, strict=True))
        for o, n in split_ranges(size, shard_size, align)
    ]
    assert list(zip(file.tolist(), offset.tolist(), length.tolist(), strict=True)) == expected
    assert count.tolist() == [len(split_ranges(size, shard_size, align)) for size in sizes]


def tuple_heap(lengths: Sequence[int], candidates: Sequence[int], start: Sequence[int] | None = None) -> list[int]:
    """LPT as main placed it: a heap of (load, rank) tuples."""
    heap = [(0 if start is None else start[i], rank) for i, rank in enumerate(candidates)]
    reference.heapq.heapify(heap)
    chosen = []
    for length in lengths:
        load, rank = heap[0]
        chosen.append(rank)
        reference.heapq.heapreplace(heap, (load + length, rank))
    return chosen


lpt_lengths = st.one_of(
    st.lists(st.integers(1, 1 << 50), max_size=400),
    st.lists(st.sampled_from([1, 2, 3, 4096, 1 << 20]), max_size=2000),  # ties everywhere
    st.lists(st.integers(1, 1 << 30), max_size=2000).map(lambda xs: sorted(xs, reverse=True)),  # as LPT gives them
)


@given(lpt_lengths, st.sets(st.integers(0, 3000), min_size=1, max_size=300))
@settings(max_examples=300, deadline=None)
def test_lpt_owners_is_the_tuple_heap(lengths: list[int], ranks: set[int]) -> None:
    """Integer keys order as (load, rank) tuples, and a batch places pieces as the heap does:
    the same rank for every piece, few ranks or many, loads of any size."""
    candidates = sorted(ranks)
    assert lpt_owners(np.array(lengths, dtype=np.int64), candidates).tolist() == tuple_heap(lengths, candidates)


def test_lpt_owners_where_batches_come_out_short() -> None:
    """A few huge pieces, then a flood of tiny ones onto the ranks left light: the least-loaded
    rank takes many in a row (short batches, then stretches of the heap), and back."""
    rng = random.Random(7)
    lengths = sorted([rng.randrange(1 << 30, 1 << 31) for _ in range(150)], reverse=True)
    lengths += sorted([rng.randrange(1, 1 << 12) for _ in range(30_000)], reverse=True)
    lengths += [1] * 5000
    candidates = sorted(rng.sample(range(1024), 200))
    assert lpt_owners(np.array(lengths, dtype=np.int64), candidates).tolist() == tuple_heap(lengths, candidates)


def test_lpt_owners_past_int64_keys() -> None:
    """Loads of exabytes: keys past int64 are Python integers, the same choice."""
    lengths = np.array([1 << 61, 1 << 61, 1 << 60, 5, 1 << 61], dtype=np.int64)
    assert lpt_owners(lengths, [0, 1, 1023]).tolist() == [0, 1, 1023, 1023, 1023]


def test_max_extents_holds_in_the_packing() -> None:
    plan = Plan([Shard(i, 0, 1, 0) for i in range(3 * MAX_EXTENTS + 5)], 1)
    old = reference.transfer_schedule(plan, 1 << 30, 2)
    new = transfer_schedule(plan, 1 << 30, 2)
    assert [len(t.extents) for t in new] == [MAX_EXTENTS] * 3 + [5]
    assert as_tuples(new) == as_tuples(old)


def test_a_long_piece_off_the_alignment_packs_tight_as_main() -> None:
    """A piece of 64 KiB or more that starts off the file's alignment cannot go O_DIRECT: packed
    tight after the one before, as main packed it."""
    shards = [Shard(0, 0, 100, 0), Shard(1, 1, DIRECT_MIN, 0), Shard(2, 0, DIRECT_MIN, 0)]
    new = transfer_schedule(Plan(shards, 1), 1 << 20, 2)
    expected = reference.transfer_schedule(reference.Plan(shards=tuple(shards), nranks=1), 1 << 20, 2)
    assert as_tuples(new) == as_tuples(expected)
    assert [e.at for e in new[0].extents] == [0, 100, ALIGN * (-(-(100 + DIRECT_MIN) // ALIGN))]
