"""CRC-32C arithmetic (core/crc.py): combine and compose checked against the crc32c of the bytes."""

from __future__ import annotations

import os
import random
from itertools import pairwise

from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.crc import combine, compose, disagree, expected


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_combine_of_large_lengths() -> None:
    a, b = os.urandom(5000), os.urandom((1 << 20) + 3)
    assert combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@settings(max_examples=200)
@given(st.binary(min_size=1, max_size=2000), st.randoms(use_true_random=False))
def test_compose_from_any_cuts_and_overlaps(data: bytes, rng: random.Random) -> None:
    size = len(data)
    cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(rng.randrange(6)))})
    pieces = [(s, e - s, crc32c(data[s:e])) for s, e in pairwise(cuts)]
    for _ in range(rng.randrange(4)):  # overlapping pieces of other cuts, true ones
        s = rng.randrange(size)
        e = rng.randrange(s + 1, size + 1)
        pieces.append((s, e - s, crc32c(data[s:e])))
    rng.shuffle(pieces)
    assert compose(size, pieces) == crc32c(data)


def test_compose_without_a_run_end_to_end_or_with_disagreeing_pieces() -> None:
    data = os.urandom(10_000)
    whole = [(0, 4096, crc32c(data[:4096])), (4096, 5904, crc32c(data[4096:]))]
    assert compose(10_000, whole) == crc32c(data)
    assert compose(10_000, whole[:1]) is None  # a gap
    assert compose(10_000, [(0, 4000, crc32c(data[:4000])), *whole[1:]]) is None  # edges that do not meet
    wrong = (0, 4096, crc32c(b"x" + data[1:4096]))
    assert compose(10_000, [*whole, wrong]) is None  # two versions of the same bytes
    assert compose(0, []) == 0 == crc32c(b"")
    assert compose(10, [(5, 10, 0), (-1, 2, 0)]) is None  # outside the file: ignored


def test_pieces_that_disagree_are_told_apart_from_pieces_that_do_not_tile() -> None:
    data = os.urandom(8192)
    good = [(0, 4096, crc32c(data[:4096])), (4096, 4096, crc32c(data[4096:]))]
    flipped = (0, 4096, crc32c(b"x" + data[1:4096]))
    assert not disagree(8192, good) and not disagree(8192, good[:1])  # a gap is no disagreement
    assert disagree(8192, [*good, flipped])  # the same range twice, two CRCs
    whole = (0, 8192, crc32c(data))
    assert not disagree(8192, [*good, whole])
    assert disagree(8192, [good[0], (4096, 4096, crc32c(data[4096:]) ^ 1), whole])  # two runs meet differently
    sizes = [8192, 8192, 5]
    pieces = [(0, *p) for p in good] + [(1, *good[0]), (1, *flipped), (2, 0, 5, crc32c(b"hello"))]
    crcs, conflicting = expected(sizes, pieces)
    assert crcs == {0: crc32c(data), 2: crc32c(b"hello")} and conflicting == {1}
