"""Key ranges of a huge directory (azcp_cluster/core/keyspace.py): exhaustive cases and properties."""

from __future__ import annotations

import random
import uuid
from bisect import bisect_right

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.keyspace import alphabet_of, cut_points, in_piece


def _pieces(names: list[str], cuts: list[str]) -> list[list[str]]:
    bounds: list[str | None] = [None, *cuts, None]
    return [[n for n in names if in_piece(n, bounds[i], bounds[i + 1])] for i in range(len(bounds) - 1)]


def test_numbered_names_are_cut_at_the_digits_nearest_the_page_first() -> None:
    cuts = cut_points("d/", ["d/sample-00000000", "d/sample-00004999"], None, 32)
    assert cuts[:5] == [f"d/sample-0000{c}" for c in "56789"]
    assert "d/sample-0001" in cuts and "d/sample-001" in cuts and "d/sample-09" in cuts
    assert len(cuts) == 32 and cuts == sorted(cuts)


@pytest.mark.slow  # CI's slow step (.ci/run): the default suite stays under 10 minutes
def test_a_million_numbered_names_fall_into_many_pieces_none_too_large() -> None:
    names = [f"d/sample-{i:08d}" for i in range(0, 1_000_000, 7)]
    page = names[:5000]
    cuts = cut_points("d/", page, None, 32)
    rest = names[5000:]
    sizes = [len(p) for p in _pieces(rest, cuts)]
    assert sum(sizes) == len(rest)
    assert sum(1 for s in sizes if s) >= 12 and max(sizes) < len(rest) / 5


def test_hex_names_are_cut_in_hex() -> None:
    rng = random.Random(3)
    names = sorted(f"ckpt/{uuid.UUID(int=rng.getrandbits(128)).hex}.pt" for _ in range(50_000))
    cuts = cut_points("ckpt/", names[:5000], None, 16)
    assert all(set(c[len("ckpt/") :]) <= set("0123456789abcdef") for c in cuts)
    sizes = [len(p) for p in _pieces(names[5000:], cuts)]
    assert sum(1 for s in sizes if s) >= 12


def test_no_cut_outside_the_range_or_the_prefix() -> None:
    assert cut_points("d/", ["d/aa", "d/ab", "d/b-x"], "d/c", 16) == []  # none between b-x and c
    assert all("d/b" < c < "d/m" for c in cut_points("d/", ["d/a1", "d/b5"], "d/m", 50))
    assert cut_points("d/", ["e/x"], None, 8) == []  # not under the prefix: no cut
    assert cut_points("d/", [], None, 8) == [] and cut_points("d/", ["d/a"], None, 0) == []


@pytest.mark.parametrize(
    ("chars", "alphabet"),
    [({"0", "7"}, "0123456789"), ({"0", "c"}, "0123456789abcdef"), ({"q"}, "abcdefghijklmnopqrstuvwxyz")],
)
def test_the_alphabet_is_what_the_page_shows(chars: set[str], alphabet: str) -> None:
    assert alphabet_of(chars) == alphabet
    assert "-" in alphabet_of({"-", "a"}) and "/" in alphabet_of({"é"})


def test_a_name_equal_to_a_cut_is_in_the_piece_before_it() -> None:
    assert in_piece("d/5", "d/4", "d/5") and not in_piece("d/5", "d/5", "d/6")
    assert in_piece("d/0", None, "d/5") and in_piece("d/z", "d/5", None)


names_strategy = st.lists(
    st.text(alphabet=st.sampled_from("09afAZ-_. é/"), min_size=1, max_size=8).map(lambda s: "p/" + s),
    min_size=2,
    max_size=200,
    unique=True,
).map(sorted)


@settings(max_examples=300, deadline=None)
@given(names=names_strategy, page=st.integers(1, 50), most=st.integers(1, 40), hi_at=st.integers(0, 250))
def test_the_pieces_are_the_rest_of_the_range_each_name_once(
    names: list[str], page: int, most: int, hi_at: int
) -> None:
    page = min(page, len(names))
    hi = names[hi_at] if hi_at < len(names) and names[hi_at] > names[page - 1] else None
    cuts = cut_points("p/", names[:page], hi, most)
    last = names[page - 1]
    assert cuts == sorted(set(cuts)) and len(cuts) <= most
    assert all(last < c and (hi is None or c < hi) and c.startswith("p/") for c in cuts)
    rest = [n for n in names if in_piece(n, last, hi)]
    pieces = _pieces(rest, cuts)
    assert [n for piece in pieces for n in piece] == rest  # in order, each once
    # A piece is what a listing from its cut reads up to the next: ascending, contiguous.
    for i, piece in enumerate(pieces):
        if piece and i:
            assert bisect_right(rest, cuts[i - 1]) == rest.index(piece[0])


def test_names_order_by_utf16_code_unit_as_the_service_orders_them() -> None:
    from azcp_cluster.core.keyspace import ascending, order

    assert order("\uff01") > order("\U0001f600")  # a code point order says the opposite
    assert "\uff01" < "\U0001f600"
    assert ascending(["d/a", "d/\U0001f600", "d/\uff01"]) and not ascending(["d/a", "d/\uff01", "d/\U0001f600"])
    assert not ascending(["d/a", "d/a"])  # strictly
    assert in_piece("d/\uff01", "d/\U0001f600", None) and not in_piece("d/\U0001f600", "d/\uff01", None)
