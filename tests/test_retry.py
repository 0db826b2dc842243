"""Tests for backoff and Retry-After parsing (azcp_cluster/core/retry.py)."""

from __future__ import annotations

import asyncio
import random
from email.utils import formatdate

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.retry import BASE_DELAY, MAX_DELAY, RETRYABLE_STATUS, Retries, backoff_delay, parse_retry_after

NOW = 1_700_000_000.0  # a fixed "now" (2023-11-14), so the tests never read the clock

# ---------------------------------------------------------------------------------------
# backoff_delay


def ceiling(attempt: int, base: float = BASE_DELAY, cap: float = MAX_DELAY) -> float:
    return min(cap, base * 2.0 ** min(attempt, 64))


@given(attempt=st.integers(0, 10_000), seed=st.integers(0, 2**32))
@settings(max_examples=300)
def test_backoff_within_half_to_full_ceiling(attempt: int, seed: int) -> None:
    delay = backoff_delay(attempt, None, random.Random(seed))
    top = ceiling(attempt)
    assert top / 2 <= delay <= top
    assert delay <= MAX_DELAY


@given(
    attempt=st.integers(0, 40),
    retry_after=st.floats(0, 10_000, allow_nan=False),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=300)
def test_backoff_honours_retry_after(attempt: int, retry_after: float, seed: int) -> None:
    delay = backoff_delay(attempt, retry_after, random.Random(seed))
    honoured = min(retry_after, 5 * MAX_DELAY)  # a huge Retry-After is capped, not obeyed blindly
    assert delay >= honoured
    assert delay <= max(ceiling(attempt), honoured)
    assert delay >= ceiling(attempt) / 2


@given(
    attempt=st.integers(0, 40),
    base=st.floats(0.001, 10),
    cap=st.floats(0.01, 1000),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=200)
def test_backoff_custom_base_and_cap(attempt: int, base: float, cap: float, seed: int) -> None:
    delay = backoff_delay(attempt, None, random.Random(seed), base=base, cap=cap)
    top = min(cap, base * 2**attempt)
    assert top / 2 <= delay <= top


def test_backoff_grows_then_caps() -> None:
    rng = random.Random(7)
    assert BASE_DELAY / 2 <= backoff_delay(0, None, rng) <= BASE_DELAY
    assert 4 * BASE_DELAY <= backoff_delay(3, None, rng) <= 8 * BASE_DELAY
    assert MAX_DELAY / 2 <= backoff_delay(30, None, rng) <= MAX_DELAY
    assert MAX_DELAY / 2 <= backoff_delay(5000, None, rng) <= MAX_DELAY  # no overflow on huge attempts


def test_backoff_is_reproducible_with_a_seed_and_jittered() -> None:
    first = [backoff_delay(a % 8, None, random.Random(42)) for a in range(40)]
    again = [backoff_delay(a % 8, None, random.Random(42)) for a in range(40)]
    assert first == again
    rng = random.Random(42)
    draws = [backoff_delay(6, None, rng) for _ in range(50)]
    assert len(set(draws)) > 40  # full jitter: clients do not come back in lockstep


def test_retryable_statuses() -> None:
    assert {408, 429, 500, 502, 503, 504} <= RETRYABLE_STATUS
    assert not {200, 206, 400, 401, 403, 404, 409, 412, 416} & RETRYABLE_STATUS


# ---------------------------------------------------------------------------------------
# parse_retry_after


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("0", 0.0),
        ("120", 120.0),
        (" 7 ", 7.0),
        ("-5", None),
        ("1.5", None),
        ("soon", None),
        ("Wed, 32 Oct 2015 07:28:00 GMT", None),
        ("Mon, 01 Jan 99999 00:00:00 GMT", None),
        ("²", None),  # str.isdigit() is True, float() refuses it
        ("١٢", None),  # Arabic-Indic digits are not delta-seconds
    ],
)
def test_parse_retry_after_examples(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value, NOW) == expected


def test_parse_retry_after_http_dates() -> None:
    assert parse_retry_after(formatdate(NOW + 30, usegmt=True), NOW) == pytest.approx(30.0)
    assert parse_retry_after(formatdate(NOW - 3600, usegmt=True), NOW) == 0.0  # already past: no wait
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 1445412480.0 - 90) == pytest.approx(90.0)
    assert parse_retry_after("Wed, 21 Oct 2015 09:28:00 +0200", 1445412480.0 - 1) == pytest.approx(1.0)


@given(st.integers(0, 10**9))
@settings(max_examples=100)
def test_parse_retry_after_seconds(seconds: int) -> None:
    assert parse_retry_after(str(seconds), NOW) == float(seconds)


@given(st.integers(-(10**6), 10**7))
@settings(max_examples=100)
def test_parse_retry_after_dates(delta: int) -> None:
    header = formatdate(NOW + delta, usegmt=True)
    assert parse_retry_after(header, NOW) == pytest.approx(max(0.0, delta))


@given(st.text(max_size=40))
@settings(max_examples=500)
def test_parse_retry_after_never_raises(value: str) -> None:
    """Whatever a server or proxy sends, the answer is a non-negative delay or None."""
    result = parse_retry_after(value, NOW)
    assert result is None or (isinstance(result, float) and result >= 0)


# ---------------------------------------------------------------------------------------
# Retries: the one helper of the download's and the listing's retry loops


def _retries(limit: int, seed: int) -> tuple[Retries, list[float]]:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    return Retries(limit, random.Random(seed), sleep), slept


@given(limit=st.integers(0, 12), seed=st.integers(0, 2**32), after=st.one_of(st.none(), st.floats(0, 500)))
@settings(max_examples=200)
def test_retries_wait_backoff_delays_in_turn_and_stop_at_the_limit(limit: int, seed: int, after: float | None) -> None:
    """Exactly ``limit`` pauses before ``exhausted``, each the delay backoff_delay gives for its
    attempt from the same random stream (Retry-After passed through)."""
    retries, slept = _retries(limit, seed)
    rng = random.Random(seed)
    expected = []
    while not retries.exhausted:
        asyncio.run(retries.pause(after))
        expected.append(backoff_delay(len(expected), after, rng))
    assert retries.attempt == limit == len(slept)
    assert slept == expected


def test_retries_honour_retry_after_and_count_attempts() -> None:
    retries, slept = _retries(3, 0)
    assert not retries.exhausted and retries.attempt == 0
    asyncio.run(retries.pause(20.0))  # the first ceiling is BASE_DELAY: Retry-After wins
    assert slept == [20.0] and retries.attempt == 1
    asyncio.run(retries.pause(10 * MAX_DELAY))  # bounded at five times the cap
    assert slept[-1] == 5 * MAX_DELAY
    asyncio.run(retries.pause())
    assert BASE_DELAY * 2 <= slept[-1] <= BASE_DELAY * 4 and retries.exhausted


def test_no_retries_is_exhausted_at_once() -> None:
    retries, slept = _retries(0, 0)
    assert retries.exhausted and slept == []
