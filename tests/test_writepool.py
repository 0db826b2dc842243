"""The download's buffer pool: a request waits for a buffer without polling, no wake-up is lost,
and a streaming root's pool holds what it wrote for the fan-out without losing a buffer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.api import make_config
from azcp_cluster.core.blocks import SPARE_BUFFERS, holdable, pool_buffers, pool_buffers_for
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectFile
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.download.writepool import BlockWrites, UnitWrites, WritePool


@pytest.fixture
def pool() -> WritePool:
    cfg = make_config("http://127.0.0.1:1/devstoreaccount1/c", "/tmp/unused", {"block_size": 65536, "concurrency": 1})
    return WritePool(cfg)


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[NodeWriter]:
    (tmp_path / "dest").mkdir()
    tree = DestTree(str(tmp_path / "dest"))
    with NodeWriter([], tree, 1) as made:
        yield made
    tree.close()


async def _spin(times: int = 20) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


def test_a_waiting_request_is_woken_by_the_write_that_frees_a_buffer(
    pool: WritePool, writer: NodeWriter, tmp_path: Path
) -> None:
    target_path = tmp_path / "f.bin"
    target_path.write_bytes(b"\0" * pool.size)

    async def main() -> bytes:
        pool.bind(asyncio.get_running_loop())
        held = [await pool.take() for _ in range(len(pool.free))]
        waiting = asyncio.ensure_future(pool.take())
        await _spin()
        assert not waiting.done()  # every buffer is held: the request waits
        assert len(pool.waiters) == 1
        held[0][:] = 7
        target = DirectFile(str(target_path))
        tracker = BlockWrites(asyncio.get_running_loop(), target)
        pool.submit(writer, target, held[0], pool.size, 0, tracker)
        got = await asyncio.wait_for(waiting, 5)  # the writer thread hands the buffer back
        await tracker.wait()
        assert target.fd == -1  # closed once its writes were done
        assert got is held[0]
        assert not pool.waiters
        return target_path.read_bytes()

    assert asyncio.run(main()) == b"\7" * pool.size


def test_a_wake_up_taken_by_a_cancelled_request_passes_to_the_next(pool: WritePool) -> None:
    async def main() -> None:
        pool.bind(asyncio.get_running_loop())
        held = [await pool.take() for _ in range(len(pool.free))]
        first = asyncio.ensure_future(pool.take())
        second = asyncio.ensure_future(pool.take())
        await _spin()
        pool.give_back(held.pop())  # wakes the first waiter...
        first.cancel()  # ...which is cancelled before it runs
        got = await asyncio.wait_for(second, 5)
        assert isinstance(got, np.ndarray)
        assert first.cancelled()
        assert not pool.waiters

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_no_trace(pool: WritePool) -> None:
    async def main() -> None:
        pool.bind(asyncio.get_running_loop())
        held = [await pool.take() for _ in range(len(pool.free))]
        waiting = asyncio.ensure_future(pool.take())
        await _spin()
        waiting.cancel()
        await _spin()
        assert not pool.waiters  # a later write must not try to wake it (nor a closed loop)
        pool.give_back(held.pop())
        assert len(pool.free) == 1

    asyncio.run(main())


@pytest.mark.parametrize(("concurrency", "blocks", "expected"), [(64, 1, 9), (64, 10, 18), (64, 1000, 72), (4, 3, 11)])
def test_the_pool_is_no_larger_than_the_requests_can_fill(concurrency: int, blocks: int, expected: int) -> None:
    # One buffer per request in flight (at most one per block) plus the spares.
    assert pool_buffers_for(concurrency, blocks) == expected == min(pool_buffers(concurrency), blocks + 8)


# -- held buffers: a streaming root sends what its download landed from memory ---------------


class _Written:
    """A node writer whose writes finish at once (``fail``: with that error); records them."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.writes: list[tuple[int, bytes]] = []

    def write(
        self, target: object, data: np.ndarray, offset: int, done: Callable[[BaseException | None], None]
    ) -> None:
        self.writes.append((offset, bytes(data)))
        done(self.fail)


def _write(
    pool: WritePool, writer: _Written, file: int, offset: int, fill: int, length: int | None = None
) -> np.ndarray:
    """Take a buffer, fill it with ``fill`` and submit its first ``length`` bytes (all: None)."""
    loop = asyncio.new_event_loop()
    try:
        pool.bind(loop)
        buf = pool.free.pop()
        buf[:] = fill
        n = pool.size if length is None else length
        pool.submit(writer, DirectFile.__new__(DirectFile), buf, n, offset, UnitWrites(loop), file)  # type: ignore[arg-type]
        return buf
    finally:
        loop.close()


def test_a_kept_buffer_is_copied_once_then_given_back(pool: WritePool) -> None:
    pool.hold_written(4)
    free = len(pool.free)
    _write(pool, _Written(), 3, pool.size, 7)
    assert len(pool.free) == free - 1 and len(pool.held) == 1  # held, not given back
    out = np.zeros(pool.size, dtype=np.uint8)
    assert pool.copy_held(3, pool.size, out)
    assert bytes(out) == b"\7" * pool.size
    assert len(pool.free) == free and not pool.held
    assert not pool.copy_held(3, pool.size, out)  # read once: the next time it is the disk's


def test_a_pool_that_keeps_nothing_gives_every_buffer_back(pool: WritePool) -> None:
    free = len(pool.free)
    _write(pool, _Written(), 0, 0, 1)  # hold_written never called: a worker's, or two phases
    assert len(pool.free) == free and not pool.held
    assert not pool.copy_held(0, 0, np.zeros(pool.size, dtype=np.uint8))


def test_no_more_than_the_limit_is_kept(pool: WritePool) -> None:
    pool.hold_written(1)
    free = len(pool.free)
    _write(pool, _Written(), 0, 0, 1)
    _write(pool, _Written(), 0, pool.size, 2)  # over the limit: given back as before
    assert len(pool.held) == 1 and len(pool.free) == free - 1
    out = np.zeros(pool.size, dtype=np.uint8)
    assert not pool.copy_held(0, pool.size, out)
    assert pool.copy_held(0, 0, out) and bytes(out) == b"\1" * pool.size


def test_a_failed_write_is_never_kept(pool: WritePool) -> None:
    pool.hold_written(4)
    free = len(pool.free)
    _write(pool, _Written(fail=OSError(5, "EIO")), 0, 0, 1)
    assert not pool.held and len(pool.free) == free


def test_a_range_kept_in_part_is_read_from_the_disk_and_its_buffers_given_back(pool: WritePool) -> None:
    pool.hold_written(4)
    free = len(pool.free)
    _write(pool, _Written(), 0, 0, 1)
    _write(pool, _Written(), 0, pool.size, 2)  # the third buffer's bytes were never held
    _write(pool, _Written(), 0, 3 * pool.size, 4)  # beyond a gap, and beyond the range
    assert not pool.copy_held(0, 0, np.zeros(3 * pool.size, dtype=np.uint8))
    # Each block is read once: none inside the range is held for ever; the one after it stays.
    assert list(pool.held) == [(0, 3 * pool.size)] and len(pool.free) == free - 1
    _write(pool, _Written(), 0, 0, 1)
    _write(pool, _Written(), 0, 2 * pool.size, 3)  # the middle one missing this time
    assert not pool.copy_held(0, 0, np.zeros(3 * pool.size, dtype=np.uint8))
    assert list(pool.held) == [(0, 3 * pool.size)]


def test_a_range_over_several_kept_buffers_and_a_short_last_one(pool: WritePool) -> None:
    pool.hold_written(4)
    _write(pool, _Written(), 5, 0, 1)
    _write(pool, _Written(), 5, pool.size, 2, length=100)  # a file's last, short block
    out = np.zeros(pool.size + 100, dtype=np.uint8)
    assert pool.copy_held(5, 0, out)
    assert bytes(out) == b"\1" * pool.size + b"\2" * 100


@pytest.mark.parametrize("limit", [1, 4])
def test_a_block_fetched_again_keeps_the_newest_copy(pool: WritePool, limit: int) -> None:
    """Also when the pool holds no more: what is held is what the disk has."""
    pool.hold_written(limit)
    free = len(pool.free)
    _write(pool, _Written(), 0, 0, 1)
    _write(pool, _Written(), 0, 0, 9)  # its request retried: the same block written again
    assert len(pool.held) == 1 and len(pool.free) == free - 1  # the older buffer came back
    out = np.zeros(pool.size, dtype=np.uint8)
    assert pool.copy_held(0, 0, out) and bytes(out) == b"\x09" * pool.size


def test_a_closed_pool_holds_no_buffer_and_takes_none_back(pool: WritePool) -> None:
    pool.hold_written(4)
    _write(pool, _Written(), 0, 0, 1)
    held = pool.free.pop()
    pool.close()
    assert not pool.held and not pool.free  # its memory goes with the last reference
    writer = _Written()
    loop = asyncio.new_event_loop()
    try:
        pool.submit(writer, DirectFile.__new__(DirectFile), held, pool.size, 0, UnitWrites(loop), 0)  # type: ignore[arg-type]
    finally:
        loop.close()
    assert not pool.held and not pool.free  # a write that ends after the close brings nothing back
    assert not pool.copy_held(0, 0, np.zeros(pool.size, dtype=np.uint8))


@settings(max_examples=200, deadline=None)
@given(
    limit=st.integers(0, 6),
    steps=st.lists(
        st.tuples(st.sampled_from(["write", "fail", "copy"]), st.integers(0, 1), st.integers(0, 3), st.integers(1, 3)),
        max_size=30,
    ),
)
def test_every_buffer_is_free_kept_or_nowhere_twice(limit: int, steps: list[tuple[str, int, int, int]]) -> None:
    """Whatever is written, fails or is copied, in any order: every buffer of the pool is free
    or held, never both and never lost, and what is copied out is what was written last there."""
    cfg = make_config("http://127.0.0.1:1/devstoreaccount1/c", "/tmp/unused", {"block_size": 65536, "concurrency": 1})
    pool = WritePool(cfg)
    pool.hold_written(limit)
    everything = {id(b) for b in pool.free}
    last: dict[tuple[int, int], int] = {}
    for n, (kind, file, block, count) in enumerate(steps):
        if kind == "copy":
            out = np.zeros(count * pool.size, dtype=np.uint8)
            wanted = [(file, (block + i) * pool.size) for i in range(count)]
            if pool.copy_held(file, block * pool.size, out):
                for i, key in enumerate(wanted):
                    assert bytes(out[i * pool.size : (i + 1) * pool.size]) == bytes([last[key]]) * pool.size
            for key in wanted:
                last.pop(key, None)
            continue
        if not pool.free:
            continue
        fill = n % 251
        _write(pool, _Written(fail=OSError(5, "EIO") if kind == "fail" else None), file, block * pool.size, fill)
        key = (file, block * pool.size)
        if kind == "write" and key in pool.held:
            assert pool.held[key][1][0] == fill  # the newest write is the one held
            last[key] = fill
        assert len(pool.held) <= max(limit, 0)
    held = [id(b) for b in pool.free] + [id(buf) for _, buf in pool.held.values()]
    assert len(held) == len(set(held)) and set(held) == everything


@pytest.mark.parametrize(
    ("buffers", "requests", "per_transfer", "held"),
    [(24, 2, 1, 18), (24, 16, 1, 4), (24, 16, 4, 4), (24, 16, 5, 0), (16, 8, 8, 0), (72, 64, 8, 0), (9, 1, 1, 4)],
)
def test_a_pool_keeps_what_its_requests_leave_spare_if_that_holds_a_transfer(
    buffers: int, requests: int, per_transfer: int, held: int
) -> None:
    """One buffer per request in flight and four spares stay with the download; the rest is held
    only if a whole transfer fits (a 256 MiB share streams 16 MiB transfers, 8 buffers of 2 MiB:
    4 held would never serve one and only take the download's spares)."""
    assert holdable(buffers, requests, per_transfer) == held
    assert buffers - held >= requests + SPARE_BUFFERS // 2 or held == 0
