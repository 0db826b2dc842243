"""The bandwidth pacer and rate parsing (azcp_cluster/throttle.py, config.parse_rate)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.config import GiB, MiB, parse_rate
from azcp_cluster.errors import UsageError
from azcp_cluster.throttle import Pacer, share


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pacer_example() -> None:
    clock = FakeClock()
    pacer = Pacer(rate=100.0, burst=100.0, clock=clock)
    assert pacer.reserve(100) == 0.0  # the burst: the first block goes at once
    assert pacer.reserve(100) == pytest.approx(1.0)  # then one block per second
    assert pacer.reserve(50) == pytest.approx(1.5)
    clock.now = 10.0  # idle time earns at most one burst
    assert pacer.reserve(100) == 0.0
    assert pacer.reserve(100) == pytest.approx(1.0)


def test_pacer_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Pacer(0, 1, FakeClock())
    with pytest.raises(ValueError):
        share(100, 0)
    assert share(100, 4) == 25


@given(
    steps=st.lists(st.tuples(st.floats(0, 3), st.integers(1, 500)), min_size=1, max_size=40),
    rate=st.floats(10, 1000),
    burst=st.floats(0, 600),
)
@settings(max_examples=300, deadline=None)
def test_pacer_never_exceeds_rate_plus_burst(steps: list[tuple[float, int]], rate: float, burst: float) -> None:
    clock = FakeClock()
    pacer = Pacer(rate, burst, clock)
    asked, started, sizes = [], [], []
    for gap, size in steps:
        clock.now += gap
        wait = pacer.reserve(size)
        assert wait >= 0
        asked.append(clock.now)
        started.append(clock.now + wait)
        sizes.append(size)
    for i in range(len(sizes)):
        for j in range(i, len(sizes)):
            # Bytes of requests i..j fit into the time from i's asking to j's start, plus a burst.
            assert sum(sizes[i : j + 1]) <= rate * (started[j] - asked[i]) + burst + sizes[i] * 1e-9 + 1e-6
    # And no request waits longer than needed: the last one starts as early as the cap allows.
    needed = max(asked[i] + sum(sizes[i:]) / rate - burst / rate for i in range(len(sizes)))
    assert started[-1] == pytest.approx(max(asked[-1], needed), abs=1e-6)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("25Gbps", 25e9 / 8),
        ("25Gb/s", 25e9 / 8),
        ("800Mbps", 1e8),
        ("1.5kbps", 187.5),
        ("3GiB/s", 3 * GiB),
        ("10MiB/s", 10 * MiB),
        ("500MB/s", 5e8),
        ("1000", 1000),
    ],
)
def test_parse_rate(text: str, value: float) -> None:
    assert parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["0", "0Gbps", "fast", "-1Gbps", "10MBps", "5 parsecs", "1e9", ""])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        parse_rate(text)
