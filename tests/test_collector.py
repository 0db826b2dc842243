"""The collector's pause and freezes (collector.py): counted, and a host's own freeze kept."""

from __future__ import annotations

import gc

import pytest

from azcp_cluster.run import collector


@pytest.fixture(autouse=True)
def unfrozen() -> None:
    gc.unfreeze()
    assert collector._holds == 0


def test_a_paused_block_freezes_what_it_built_until_its_hold_ends() -> None:
    assert gc.isenabled()
    with collector.paused() as heap:
        assert not gc.isenabled()
        built = [(i, str(i)) for i in range(1000)]
    assert gc.isenabled() and heap.held and gc.get_freeze_count() > 0
    # The download's own freeze inside the run does not thaw what the run froze.
    with collector.frozen():
        pass
    assert gc.get_freeze_count() > 0
    heap.end()
    heap.end()  # once only
    assert gc.get_freeze_count() == 0 and collector._holds == 0
    del built


def test_a_block_that_fails_holds_nothing_and_restores_the_collector() -> None:
    with pytest.raises(RuntimeError), collector.paused() as heap:
        raise RuntimeError("a stage failed")
    assert gc.isenabled() and not heap.held and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled(), "a collector the host had disabled stays disabled"
    finally:
        gc.enable()
        collector.release()


def test_a_host_programs_own_freeze_is_kept() -> None:
    gc.freeze()  # a host program of the Python API (say, before forking workers)
    before = gc.get_freeze_count()
    with collector.paused() as heap:
        pass
    heap.end()
    assert gc.get_freeze_count() >= before > 0
    gc.unfreeze()
