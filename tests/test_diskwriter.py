"""The disk-writer service (azcp_cluster/dest/diskwriter.py): every job runs once and is reported, errors included."""

from __future__ import annotations

import threading

import pytest

from azcp_cluster.dest.diskwriter import DiskWriter


def test_every_job_runs_once_and_its_error_reaches_done() -> None:
    writer = DiskWriter(3)
    ran: list[int] = []
    done: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        with lock:
            ran.append(i)
        if i % 7 == 0:
            raise OSError(f"disk {i}")

    for i in range(100):
        writer.submit(lambda i=i: work(i), lambda err, i=i: done.append((i, str(err) if err else None)))  # type: ignore[misc]
    writer.close()
    assert sorted(ran) == list(range(100))
    assert sorted(done) == [(i, f"disk {i}" if i % 7 == 0 else None) for i in range(100)]


def test_a_failing_callback_does_not_stop_the_writer() -> None:
    writer = DiskWriter(1)
    seen: list[int] = []

    def bad(err: BaseException | None) -> None:
        raise RuntimeError("callback")

    writer.submit(lambda: None, bad)
    writer.submit(lambda: seen.append(1), lambda err: seen.append(2))
    writer.close()
    assert seen == [1, 2]


def test_closed_writer_refuses_work_and_close_is_idempotent() -> None:
    writer = DiskWriter(2)
    assert writer.size == 2
    writer.close()
    writer.close()
    assert writer.size == 0
    with pytest.raises(RuntimeError):
        writer.submit(lambda: None, lambda err: None)
    with pytest.raises(ValueError):
        DiskWriter(0)
