"""One request's writes (writepool.RequestWrites, the one tracker that replaced UnitWrites,
BlockWrites and Both): each block's end with its own first error, the request's end, and the
file closed once, by the wait or, when the wait is cancelled, by the last write."""

from __future__ import annotations

import asyncio
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.download.writepool import RequestWrites


class _Target:
    """A file that counts its closes."""

    def __init__(self) -> None:
        self.closes = 0
        self.refused = False

    def close(self) -> None:
        self.closes += 1


async def _spin(times: int = 5) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


def test_each_block_ends_with_its_own_first_error_once_its_writes_are_done() -> None:
    async def main() -> None:
        target = _Target()
        writes = RequestWrites(asyncio.get_running_loop(), target)  # type: ignore[arg-type]
        a1, a2 = writes.started(), writes.started()
        first = writes.block_submitted()
        b1 = writes.started()
        second = writes.block_submitted()
        third = writes.block_submitted()  # a block without a write: ended at once
        assert (a1, a2, b1) == (0, 0, 1)
        assert third.done() and third.result() is None
        boom = OSError(5, "EIO")
        writes.finished(b1, boom)
        writes.finished(a1, None)
        await _spin()
        assert second.result() is boom and not first.done()  # the second block is done first
        writes.finished(a2, OSError(28, "ENOSPC"))
        await _spin()
        assert isinstance(first.result(), OSError) and first.result().errno == 28  # type: ignore[union-attr]
        await writes.wait()
        assert target.closes == 1

    asyncio.run(main())


def test_writes_ended_by_writer_threads_wake_the_loop_and_the_wait_closes_the_file() -> None:
    async def main() -> None:
        target = _Target()
        writes = RequestWrites(asyncio.get_running_loop(), target)  # type: ignore[arg-type]
        blocks = [writes.started() for _ in range(3)]
        landing = writes.block_submitted()
        threads = [threading.Thread(target=writes.finished, args=(b, None)) for b in blocks]
        for thread in threads:
            thread.start()
        assert await asyncio.wait_for(landing, 5) is None
        await asyncio.wait_for(writes.wait(), 5)
        for thread in threads:
            thread.join()
        assert target.closes == 1

    asyncio.run(main())


def test_a_cancelled_wait_leaves_the_file_to_the_last_write() -> None:
    async def main() -> None:
        target = _Target()
        writes = RequestWrites(asyncio.get_running_loop(), target)  # type: ignore[arg-type]
        block = writes.started()
        waiting = asyncio.ensure_future(writes.wait())
        await _spin()
        waiting.cancel()
        await _spin()
        assert waiting.cancelled() and target.closes == 0  # a writer thread still has the descriptor
        writes.finished(block, None)
        assert target.closes == 1

    asyncio.run(main())


def test_a_cancelled_landing_stays_cancelled_when_its_writes_end() -> None:
    async def main() -> None:
        writes = RequestWrites(asyncio.get_running_loop())
        block = writes.started()
        landing = writes.block_submitted()
        landing.cancel()
        writes.finished(block, None)
        await _spin()
        assert landing.cancelled()
        await writes.wait()

    asyncio.run(main())


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.integers(0, 3), min_size=1, max_size=5), data=st.data())
def test_in_any_order_of_ends_every_block_and_the_request_end_once(blocks: list[int], data: st.DataObject) -> None:
    """``blocks``: the writes of each block; their ends come in any order, some failing."""

    async def main() -> None:
        target = _Target()
        writes = RequestWrites(asyncio.get_running_loop(), target)  # type: ignore[arg-type]
        started: list[int] = []
        landings = []
        for count in blocks:
            started += [writes.started() for _ in range(count)]
            landings.append(writes.block_submitted())
        order = data.draw(st.permutations(range(len(started))))
        failing = data.draw(st.sets(st.sampled_from(range(len(started))))) if started else set()
        errors: dict[int, OSError] = {}
        for k in order:
            error = OSError(k, "write") if k in failing else None
            writes.finished(started[k], error)
            if error is not None:
                errors.setdefault(started[k], error)
        await _spin()
        assert [landing.result() for landing in landings] == [errors.get(b) for b in range(len(blocks))]
        await writes.wait()
        assert target.closes == 1 and writes.outstanding == 0

    asyncio.run(main())
