"""Resume by block (resume.py, pure; plan.plan_transfers with ``partial``): the journal's wire
form, what it may claim, and a plan that moves exactly what some copy lacks."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core import resume
from azcp_cluster.core.packing import transfer_schedule
from azcp_cluster.core.plan import plan_transfers
from azcp_cluster.core.resume import GEOMETRY, MAGIC, Drop, Expected, Header, Range, Segment

KiB = 1024
MiB = 1 << 20
A = 4096


def _journal(*records: resume.Record) -> bytes:
    return MAGIC + resume.encode(records)


# -- the wire form ---------------------------------------------------------------------------


def test_records_round_trip() -> None:
    records = [
        Header(0, "dir/ä.bin", 10 * MiB, '"0x8D"|http://h/c|dir/ä.bin', (7 << 96) | (0 << 64) | 123456),
        Range(0, 0, 4 * MiB, 0xFFFFFFFF),
        Range(0, 4 * MiB, 6 * MiB, 0x1234ABCD, False),
        Drop("dir/ä.bin"),
        Header(1, "b", 5, "t", (1 << 96) | (1000 << 64) | 9, geometry=8192, generation=0xDEADBEEF),
    ]
    got, readable = resume.decode(_journal(*records))
    assert readable and got == records


def test_a_journal_cut_at_any_byte_claims_a_prefix_of_its_records() -> None:
    records = [Header(0, "f", 64 * MiB, "t", 42), *(Range(0, i * MiB, MiB, 0) for i in range(20))]
    data = _journal(*records)
    for cut in range(len(MAGIC), len(data) + 1):
        got, readable = resume.decode(data[:cut])
        assert readable and got == records[: len(got)], cut
    assert resume.decode(data)[0] == records


def test_a_flipped_byte_ends_the_reading_there() -> None:
    records = [Header(0, "f", 64 * MiB, "t", 42), *(Range(0, i * MiB, MiB, 0) for i in range(8))]
    data = bytearray(_journal(*records))
    rng = random.Random(5)
    for _ in range(200):
        spoiled = bytearray(data)
        at = rng.randrange(len(MAGIC), len(spoiled))
        spoiled[at] ^= 1 << rng.randrange(8)
        got, readable = resume.decode(bytes(spoiled))
        assert readable and got == records[: len(got)] and len(got) < len(records)


def test_garbage_is_not_a_journal() -> None:
    rng = random.Random(1)
    for _ in range(50):
        got, readable = resume.decode(rng.randbytes(rng.randrange(0, 4096)))
        assert (got, readable) == ([], False)
    assert resume.decode(b"") == ([], False)


# -- what a journal may claim ------------------------------------------------------------------


def _fits(size: int = 64 * MiB, identity: int = 42) -> dict[str, Expected]:
    return {"f": Expected(size, "t", identity)}


def test_only_ranges_under_a_header_that_fits_count() -> None:
    journal = [Header(0, "f", 64 * MiB, "t", 42), Range(0, 0, 8 * MiB, 0), Range(0, 16 * MiB, 8 * MiB, 0)]
    assert resume.held([journal], _fits()) == {"f": [(0, 8 * MiB), (16 * MiB, 24 * MiB)]}
    for changed in (
        _fits(size=65 * MiB),  # the blob grew
        {"f": Expected(64 * MiB, "other etag", 42)},  # replaced with the same size
        _fits(identity=43),  # the temporary file is another file now
        _fits(identity=0),  # no temporary file fit to resume stands there
        {"f": Expected(64 * MiB, "t", 42, generation=5)},  # same inode number, another inode
        {"f": Expected(64 * MiB, "", 42)},  # no version to tie blocks to
        {},  # not a file this run lacks
    ):
        assert resume.held([journal], changed) == {}
    other_geometry = [Header(0, "f", 64 * MiB, "t", 42, geometry=GEOMETRY * 2), Range(0, 0, 8 * MiB, 0)]
    assert resume.held([other_geometry], _fits()) == {}


def test_a_range_without_its_header_or_past_the_end_counts_nothing() -> None:
    journal = [
        Range(0, 0, MiB, 0),
        Header(0, "f", 8 * MiB, "t", 42),
        Range(1, 0, MiB, 0),
        Range(0, 7 * MiB, 2 * MiB, 0),
    ]
    assert resume.held([journal], _fits(8 * MiB)) == {}


def test_a_drop_in_any_journal_discards_the_path_everywhere() -> None:
    first = [Header(0, "f", 64 * MiB, "t", 42), Range(0, 0, 8 * MiB, 0)]
    second = [Drop("f")]
    assert resume.held([first, second], _fits()) == {}
    assert resume.held([second, first], _fits()) == {}


def test_an_id_reused_for_a_file_that_does_not_fit_claims_nothing_for_the_first() -> None:
    journal = [Header(0, "f", 64 * MiB, "t", 42), Header(0, "g", 64 * MiB, "t", 7), Range(0, 0, 8 * MiB, 0)]
    assert resume.held([journal], _fits()) == {}


def test_held_ranges_are_merged_across_journals_and_trimmed_inward() -> None:
    size = 10 * MiB + 123
    a = [Header(3, "f", size, "t", 42), Range(3, 100, MiB, 0), Range(3, 9 * MiB, MiB + 123, 0)]
    b = [Header(0, "f", size, "t", 42), Range(0, MiB + 100, MiB, 0)]
    # 100 rounds up to 4096; MiB + 100 and 2 MiB + 100 end inside a page: down to 2 MiB; the end stays.
    assert resume.held([a, b], {"f": Expected(size, "t", 42)}) == {"f": [(A, 2 * MiB), (9 * MiB, size)]}


def test_trim_and_merge() -> None:
    assert resume.merge([(5, 9), (0, 3), (3, 4), (8, 12), (20, 20)]) == [(0, 4), (5, 12)]
    assert resume.trim([(1, A + 1), (A, 3 * A - 1), (5 * A + 7, 6 * A + 7)], 6 * A + 7) == [
        (A, 2 * A),
        (6 * A, 6 * A + 7),
    ]
    assert resume.trim([(1, A - 1)], 10 * A) == []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), max_size=12), st.integers(1, 300))
def test_merge_and_trim_never_claim_a_byte_that_was_not_written(raw: list[tuple[int, int]], size: int) -> None:
    spans = [(s, min(size, s + n)) for s, n in raw if s < size]
    written = {b for s, e in spans for b in range(s, e)}
    merged = resume.merge(spans)
    assert {b for s, e in merged for b in range(s, e)} == written
    assert all(a[1] < b[0] for a, b in pairwise(merged))
    for align in (1, 4, 16):
        kept = resume.trim(merged, size, align)
        assert {b for s, e in kept for b in range(s, e)} <= written
        assert all(s % align == 0 and (e % align == 0 or e == size) for s, e in kept)


# -- segments and the plan ---------------------------------------------------------------------


def test_segments_cut_where_the_holders_change() -> None:
    size = 100
    got = resume.segments(size, {0: [(0, size)], 5: [(0, 40), (60, 100)], 9: [(20, 50)]})
    assert got == [
        Segment(0, 20, (0, 5)),
        Segment(20, 20, (0, 5, 9)),
        Segment(40, 10, (0, 9)),
        Segment(50, 10, (0,)),
        Segment(60, 40, (0, 5)),
    ]
    assert resume.segments(size, {}) == [Segment(0, 100, ())]
    assert resume.segments(0, {1: []}) == []


Raw = dict[int, list[tuple[int, int]]]


def _pages(raw: Raw, size: int) -> dict[int, list[tuple[int, int]]]:
    """Each holder's (first page, pages) as merged byte spans inside ``size``."""
    return {
        h: resume.merge((s * A, min(size, (s + n) * A)) for s, n in spans if s * A < size) for h, spans in raw.items()
    }


holdings_strategy = st.dictionaries(
    st.sampled_from([0, 2, 4, 6]),
    st.lists(st.tuples(st.integers(0, 63), st.integers(1, 16)), max_size=4),
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(holdings_strategy, st.integers(1, 64))
def test_every_byte_is_in_one_segment_with_exactly_its_holders(
    raw: dict[int, list[tuple[int, int]]], pages: int
) -> None:
    size = pages * A
    holdings = {
        h: resume.merge((s * A, min(size, (s + n) * A)) for s, n in spans if s * A < size) for h, spans in raw.items()
    }
    segs = resume.segments(size, holdings)
    assert sum(s.length for s in segs) == size and segs[0].offset == 0
    for seg, nxt in pairwise(segs):
        assert seg.offset + seg.length == nxt.offset and seg.holders != nxt.holders
    for seg in segs:
        for probe in (seg.offset, seg.offset + seg.length - 1):
            assert seg.holders == tuple(sorted(h for h, sp in holdings.items() if any(s <= probe < e for s, e in sp)))


@settings(max_examples=60, deadline=None)
@given(holdings_strategy, st.integers(1, 64), st.sampled_from([3 * A, 16 * A, 1 << 30]))
def test_the_plan_moves_every_missing_byte_once_and_sends_it_only_to_those_that_lack_it(
    raw: Raw, pages: int, shard: int
) -> None:
    # Four nodes of two ranks: the leaders are 0, 2, 4, 6; the plan places the download on all eight.
    leaders = [0, 2, 4, 6]
    size = pages * A
    holdings = {
        h: resume.merge((s * A, min(size, (s + n) * A)) for s, n in spans if s * A < size) for h, spans in raw.items()
    }
    holdings = {h: sp for h, sp in holdings.items() if sp}
    segs = tuple(resume.segments(size, holdings))
    sizes = [size, 5 * A]  # file 1: nobody has it
    plan = plan_transfers(sizes, [(), ()], 8, shard, copies=4, partial={0: segs}, receivers=leaders)
    group_of = [r // 2 for r in range(8)]
    schedule = transfer_schedule(plan, 8 * A, 4, root_of=group_of)
    # Counted in pages of A bytes (every holding, segment, shard and slot is whole pages): a
    # set of every byte made this test take seconds.
    got: dict[int, dict[int, set[int]]] = {}  # group -> file -> pages it gets
    for transfer in schedule:
        for extent in transfer.extents:
            assert extent.offset % A == 0 and extent.length % A == 0, extent
            pages_of = range(extent.offset // A, (extent.offset + extent.length) // A)
            for group in transfer.receivers:
                got.setdefault(group, {}).setdefault(extent.file, set()).update(pages_of)
            if not any(
                s.peer and s.file == extent.file and s.offset <= extent.offset < s.offset + s.length
                for s in plan.shards
            ):
                got.setdefault(transfer.root, {}).setdefault(extent.file, set()).update(pages_of)  # its own download
    downloaded = sum(s.length for s in plan.shards if not s.peer)
    assert downloaded == 5 * A + sum(s.length for s in segs if not s.holders)
    for group, leader in enumerate(leaders):
        have = {p for s, e in holdings.get(leader, []) for p in range(s // A, e // A)}
        arriving = got.get(group, {}).get(0, set())
        assert not arriving & have, "a node is sent bytes it kept"
        assert arriving | have == set(range(pages)), "a node lacks bytes after the run"
        assert got.get(group, {}).get(1, set()) == set(range(5))
    for s in plan.shards:
        assert s.offset % A == 0, "a shard of a resumed file starts off the alignment"
        if s.peer:
            assert s.owner == min(
                h for h, sp in holdings.items() if any(a <= s.offset and s.offset + s.length <= b for a, b in sp)
            )


def test_a_segment_every_copy_holds_moves_not_at_all() -> None:
    segs = (Segment(0, 8 * A, (0, 1)), Segment(8 * A, 8 * A, (1,)))
    plan = plan_transfers([16 * A], [()], 2, 1 << 30, partial={0: segs}, receivers=[0, 1])
    assert [(s.offset, s.length, s.owner, s.peer) for s in plan.shards] == [(8 * A, 8 * A, 1, True)]
    assert plan.receivers == {(0, 8 * A): (0,)}
    assert plan.loads() == [0, 0]


@pytest.mark.parametrize("owners", [None, [1]])
def test_missing_segments_join_the_lpt_with_whole_files(owners: list[int] | None) -> None:
    segs = (Segment(0, 4 * MiB, (0,)), Segment(4 * MiB, 60 * MiB, ()))
    plan = plan_transfers(
        [64 * MiB, 30 * MiB], [(), ()], 2, 16 * MiB, owners=owners, partial={0: segs}, receivers=[0, 1]
    )
    azure = [s for s in plan.shards if not s.peer]
    assert sum(s.length for s in azure if s.file == 0) == 60 * MiB
    assert min(s.offset for s in azure if s.file == 0) == 4 * MiB
    assert sum(plan.loads()) == 90 * MiB
    if owners is None:
        assert plan.spread() < 0.2
    else:
        assert plan.loads()[0] == 0


# -- a running journal's turns ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "since", "due"),
    [
        (0, 0.0, False),
        (0, resume.TURN_MAX - 0.01, False),  # nothing written: only by time
        (0, resume.TURN_MAX, True),
        (resume.TURN_BYTES, resume.TURN_MIN - 0.01, False),  # never sooner than TURN_MIN
        (resume.TURN_BYTES, resume.TURN_MIN, True),
        (resume.TURN_BYTES - 1, resume.TURN_MAX - 0.01, False),
        (10 * resume.TURN_BYTES, 0.0, False),
    ],
)
def test_a_turn_is_due_by_time_or_by_bytes(written: int, since: float, due: bool) -> None:
    assert resume.turn_due(written, since) is due


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 1 << 40),
    st.floats(0, 10, allow_nan=False),
    st.integers(0, 1 << 30),
    st.floats(0, 5, allow_nan=False),
    st.one_of(st.none(), st.integers(1, 1 << 32)),
)
def test_more_bytes_or_more_time_never_puts_a_turn_off(
    written: int, since: float, more: int, later: float, early: int | None
) -> None:
    least, most = 0.25, 1.0
    if resume.turn_due(written, since, most, least, early):
        assert resume.turn_due(written + more, since + later, most, least, early)
    assert resume.turn_due(written, max(since, most), most, least, early)  # the interval always ends it
    if early is None:  # by time only: the bytes change nothing
        assert resume.turn_due(written, since, most, least, None) == (since >= most)
