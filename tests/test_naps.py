"""The growing naps (azcp_cluster/core/naps.py) on a fake sleep: first, doubling, capped, reset."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from azcp_cluster.core.naps import Naps, nap_until


def test_naps_double_from_the_first_up_to_the_cap() -> None:
    slept: list[float] = []
    naps = Naps(0.0001, 0.001, slept.append)
    for _ in range(7):
        naps.nap()
    assert slept == pytest.approx([0.0001, 0.0002, 0.0004, 0.0008, 0.001, 0.001, 0.001])


def test_reset_starts_again_from_the_first_and_a_nap_instead_still_grows() -> None:
    slept: list[float] = []
    naps = Naps(0.0002, 0.002, slept.append)
    naps.nap()
    naps.nap()
    naps.reset()
    naps.nap()
    naps.nap(0.005)  # the driver's idle nap: its own length, and the next still twice as long
    naps.nap()
    assert slept == pytest.approx([0.0002, 0.0004, 0.0002, 0.005, 0.0008])


def test_naps_refuse_nonsense() -> None:
    for first, cap in ((0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)):
        with pytest.raises(ValueError):
            Naps(first, cap, lambda s: None)


@given(tests=st.integers(0, 40))
def test_nap_until_naps_once_per_failed_test_and_runs_between_before_each(tests: int) -> None:
    """``done`` holds at its ``tests + 1``-th call: as many naps, growing, and ``between``
    once before each, none after the last test."""
    log: list[object] = []
    calls = iter([False] * tests + [True])

    def done() -> bool:
        log.append("test")
        return next(calls)

    nap_until(done, 0.00005, 0.002, between=lambda: log.append("between"), sleep=log.append)
    assert log[-1] == "test" and log.count("test") == tests + 1
    naps = [x for x in log if isinstance(x, float)]
    assert naps == pytest.approx([min(0.00005 * 2**i, 0.002) for i in range(tests)])
    for i in range(tests):  # each round: the test, then between, then the nap
        assert log[3 * i : 3 * i + 3] == ["test", "between", naps[i]]


def test_nap_until_does_not_nap_when_done_at_once() -> None:
    slept: list[float] = []
    nap_until(lambda: True, 0.1, 1.0, sleep=slept.append)
    assert slept == []
