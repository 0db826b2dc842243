"""The download's buffer pool: a request waits for a buffer without polling, and no wake-up is lost."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from azcp_cluster.api import make_config
from azcp_cluster.core.blocks import pool_buffers, pool_buffers_for
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectFile
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.download.writepool import BlockWrites, WritePool


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
