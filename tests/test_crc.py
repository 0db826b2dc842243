"""CRC-32 arithmetic (core/crc.py): combine and compose checked against zlib's crc32 of the
bytes (an implementation other than the tool's, ISA-L's)."""

from __future__ import annotations

import os
import random
from itertools import pairwise
from zlib import crc32

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core import crc as block_crc
from azcp_cluster.core.crc import combine, compose, disagree, expected


@settings(max_examples=200)
@given(st.binary(max_size=70_000), st.integers(0, 2**32 - 1), st.integers(0, 63))
def test_the_block_hash_is_zlibs_crc32_on_any_buffer(data: bytes, start: int, skew: int) -> None:
    # What the tool hashes: bytes, a numpy buffer's memoryview at any alignment, carried on
    # from another CRC (the body's steps), and nothing at all.
    buf = np.frombuffer(bytes(skew) + data, dtype=np.uint8)
    view = memoryview(buf)[skew:]  # type: ignore[arg-type]
    assert block_crc.crc32(view) == crc32(data) == block_crc.crc32(data)
    assert block_crc.crc32(view, start) == crc32(data, start)
    half = len(data) // 2
    assert block_crc.crc32(view[half:], block_crc.crc32(view[:half])) == crc32(data)


def test_the_block_hash_of_a_large_buffer() -> None:
    data = os.urandom(33 << 20)  # past any in-cache path of the library
    assert block_crc.crc32(data) == crc32(data)


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert combine(crc32(a), crc32(b), len(b)) == crc32(a + b)


def test_combine_of_large_lengths() -> None:
    a, b = os.urandom(5000), os.urandom((1 << 20) + 3)
    assert combine(crc32(a), crc32(b), len(b)) == crc32(a + b)


@settings(max_examples=200)
@given(st.binary(min_size=1, max_size=2000), st.randoms(use_true_random=False))
def test_compose_from_any_cuts_and_overlaps(data: bytes, rng: random.Random) -> None:
    size = len(data)
    cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(rng.randrange(6)))})
    pieces = [(s, e - s, crc32(data[s:e])) for s, e in pairwise(cuts)]
    for _ in range(rng.randrange(4)):  # overlapping pieces of other cuts, true ones
        s = rng.randrange(size)
        e = rng.randrange(s + 1, size + 1)
        pieces.append((s, e - s, crc32(data[s:e])))
    rng.shuffle(pieces)
    assert compose(size, pieces) == crc32(data)


def test_compose_without_a_run_end_to_end_or_with_disagreeing_pieces() -> None:
    data = os.urandom(10_000)
    whole = [(0, 4096, crc32(data[:4096])), (4096, 5904, crc32(data[4096:]))]
    assert compose(10_000, whole) == crc32(data)
    assert compose(10_000, whole[:1]) is None  # a gap
    assert compose(10_000, [(0, 4000, crc32(data[:4000])), *whole[1:]]) is None  # edges that do not meet
    wrong = (0, 4096, crc32(b"x" + data[1:4096]))
    assert compose(10_000, [*whole, wrong]) is None  # two versions of the same bytes
    assert compose(0, []) == 0 == crc32(b"")
    assert compose(10, [(5, 10, 0), (-1, 2, 0)]) is None  # outside the file: ignored


def test_pieces_that_disagree_are_told_apart_from_pieces_that_do_not_tile() -> None:
    data = os.urandom(8192)
    good = [(0, 4096, crc32(data[:4096])), (4096, 4096, crc32(data[4096:]))]
    flipped = (0, 4096, crc32(b"x" + data[1:4096]))
    assert not disagree(8192, good) and not disagree(8192, good[:1])  # a gap is no disagreement
    assert disagree(8192, [*good, flipped])  # the same range twice, two CRCs
    whole = (0, 8192, crc32(data))
    assert not disagree(8192, [*good, whole])
    assert disagree(8192, [good[0], (4096, 4096, crc32(data[4096:]) ^ 1), whole])  # two runs meet differently
    sizes = [8192, 8192, 5]
    pieces = [(0, *p) for p in good] + [(1, *good[0]), (1, *flipped), (2, 0, 5, crc32(b"hello"))]
    crcs, conflicting = expected(sizes, pieces)
    assert crcs == {0: crc32(data), 2: crc32(b"hello")} and conflicting == {1}
