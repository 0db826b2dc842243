"""CallPool (azcp_cluster/dest/syscalls.py): inline while the calls are fast, threads once they are slow."""

from __future__ import annotations

import os
import threading
import time

import pytest

from azcp_cluster.dest.syscalls import CALIBRATE, SLOW_CALL, CallPool, RunQueue


class _Clock:
    """A clock that advances by ``step`` seconds at each reading."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _none() -> float:
    return 0.0


def _batch(n: int) -> tuple[int, str]:
    return n, threading.current_thread().name


def test_fast_calls_stay_in_the_calling_thread() -> None:
    with CallPool(clock=_Clock(1e-7), waited=_none) as pool:
        out = pool.map(_batch, list(range(100)), calls=lambda result: 100)
        assert not pool.threaded
    assert [n for n, _ in out] == list(range(100))
    assert {name for _, name in out} == {threading.current_thread().name}


def test_slow_calls_move_to_threads_once_calibrated_and_keep_their_order() -> None:
    # Each batch "takes" 2 * SLOW_CALL per call: slow from the first mean that counts.
    per_batch = CALIBRATE // 4
    with CallPool(threads=4, clock=_Clock(2 * per_batch * SLOW_CALL), waited=_none) as pool:
        first = pool.map(_batch, list(range(10)), calls=lambda result: per_batch)
        assert pool.threaded
        later = pool.map(_batch, list(range(10, 50)), calls=lambda result: per_batch)
    inline = [name for _, name in first if not name.startswith("azcp-syscalls")]
    assert len(inline) == 4  # CALIBRATE calls timed inline, then the threads
    assert [n for n, _ in first + later] == list(range(50))
    assert all(name.startswith("azcp-syscalls") for _, name in later)


def test_a_mean_below_the_bound_is_not_slow_however_many_calls() -> None:
    with CallPool(clock=_Clock(SLOW_CALL * 0.4), waited=_none) as pool:
        pool.map(_batch, list(range(CALIBRATE * 3)), calls=lambda result: 1)
        assert not pool.threaded


def test_time_spent_waiting_for_a_cpu_is_not_the_calls_time() -> None:
    # Each batch "takes" 2 * SLOW_CALL per call, all of it waiting for a CPU (a busy machine,
    # not a slow filesystem): the calls stay inline, in map after map.
    per_batch = CALIBRATE // 4
    clock = _Clock(2 * per_batch * SLOW_CALL)
    with CallPool(threads=4, clock=clock, waited=lambda: clock.now) as pool:
        out = pool.map(_batch, list(range(40)), calls=lambda result: per_batch)
        out += pool.map(_batch, list(range(40)), calls=lambda result: per_batch)
        assert not pool.threaded
    assert {name for _, name in out} == {threading.current_thread().name}
    # Half of it waiting: the rest, SLOW_CALL a call, is still slow.
    clock = _Clock(2 * per_batch * SLOW_CALL)
    with CallPool(threads=4, clock=clock, waited=lambda: clock.now / 2) as pool:
        pool.map(_batch, list(range(40)), calls=lambda result: per_batch)
        assert pool.threaded


def test_the_run_queue_is_read_only_where_the_clock_says_slow() -> None:
    readings: list[float] = []

    def waited() -> float:
        readings.append(0.0)
        return 0.0

    with CallPool(clock=_Clock(SLOW_CALL * 0.4), waited=waited) as pool:
        pool.map(_batch, list(range(CALIBRATE * 3)), calls=lambda result: 1)
        assert not pool.threaded
    assert len(readings) == 2  # at the start and the end of the call, none per batch


def test_the_run_queue_is_read_where_linux_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    queue = RunQueue()
    first = queue()
    sum(i * i for i in range(200_000))
    assert 0.0 <= first <= queue()
    queue.close()
    assert queue() == 0.0

    def refused(*args: object) -> int:
        raise PermissionError(13, "no /proc here")

    monkeypatch.setattr(os, "open", refused)
    assert RunQueue()() == 0.0  # no /proc: nothing waited, the plain clock decides


def test_the_first_failing_batch_in_order_is_raised_and_the_rest_never_start() -> None:
    started: list[int] = []

    def fails(n: int) -> int:
        started.append(n)
        if n in (3, 5):
            time.sleep(0.05 if n == 3 else 0)  # the later failure happens first
            raise OSError(n, f"batch {n}")
        if n > 8:
            time.sleep(0.01)
        return n

    with CallPool(threads=2, clock=_Clock(1.0), waited=_none) as pool:
        pool.map(lambda n: n, list(range(CALIBRATE)), calls=lambda result: 1)  # now threaded
        assert pool.threaded
        with pytest.raises(OSError, match="batch 3"):
            pool.map(fails, list(range(400)), calls=lambda result: 1)
    assert len(started) < 400  # the queued batches were cancelled


def test_really_blocking_calls_overlap_on_threads() -> None:
    # time.sleep stands in for a stat that waits on a file server (both release the GIL).
    lock = threading.Lock()
    running = [0, 0]  # now, most at once

    def wait(n: int) -> int:
        with lock:
            running[0] += 1
            running[1] = max(running)
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        return n

    with CallPool(threads=8) as pool:
        out = pool.map(wait, list(range(CALIBRATE + 200)), calls=lambda result: 1)
        assert pool.threaded  # measured on the real clock: 2 ms a call is slow
    assert out == list(range(CALIBRATE + 200))
    assert running[1] > 1
