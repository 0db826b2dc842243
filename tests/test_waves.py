"""A streamed copy's sizes (core/waves.py): parts land, and leave, in waves; never larger than configured."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    once, both landing at the end. Now four 8 MiB blocks one after the other, 4 MiB transfers."""
    sizes = stream_sizes(32 * MiB, 16 * MiB, 16 * MiB, 64)
    assert (sizes.chunk, sizes.block, sizes.in_flight) == (4 * MiB, 8 * MiB, 1)


@pytest.mark.parametrize("bad", [(1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)])
def test_nonsense_is_refused(bad: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        stream_sizes(*bad)
