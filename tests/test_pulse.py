"""The pulse that names a stopped rank: its schedule and decision (pure), and its thread on a real MPI.

The end-to-end case (a rank stopped with SIGSTOP in the middle of a chain, named, the job ended
with exit 10) is ``tests/test_reliability.py``; every other MPI test runs with the pulse on, so
its last-pulse handshake is exercised at the end of each of them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import PeerStoppedError, UsageError
from azcp_cluster.core.pulse import MAX_TICK, PULSES_PER_TIMEOUT, Pulse
from azcp_cluster.run import liveness


def test_the_first_pulse_goes_at_once_then_one_every_interval_and_none_after_the_last() -> None:
    pulse = Pulse(timeout=8.0, started=100.0)
    assert pulse.interval == 8.0 / PULSES_PER_TIMEOUT == 2.0
    assert pulse.send_due(100.0)
    pulse.sent(100.0)
    assert not pulse.send_due(101.9)
    assert pulse.send_due(102.0)
    pulse.sent(102.0)
    pulse.ending(102.5)
    assert not pulse.send_due(110.0)


def test_the_tick_is_half_an_interval_and_never_longer_than_the_cap() -> None:
    assert Pulse(timeout=2.0, started=0).tick == 0.25
    assert Pulse(timeout=3600.0, started=0).tick == MAX_TICK


def test_silence_for_the_timeout_is_a_stop_and_a_pulse_resets_it() -> None:
    pulse = Pulse(timeout=4.0, started=0.0)
    assert not pulse.stopped(3.99)  # before the first pulse, the watch counts from its start
    assert pulse.stopped(4.0)
    pulse.heard(3.0, last=False)
    assert not pulse.stopped(6.99) and pulse.silent_for(6.5) == 3.5
    assert pulse.stopped(7.0)


def test_a_watcher_that_stood_still_itself_never_names_the_rank_it_watches_on_waking() -> None:
    """A rank stopped (SIGSTOP) and woken by the launcher's SIGCONT as it ends the job found its
    watch 'silent' for all the time it stood still, and named a live rank (a second line under
    Open MPI): a gap in its own looks of over half the timeout restarts the count."""
    pulse = Pulse(timeout=4.0, started=0.0)
    for now in (0.0, 0.5, 1.0):
        pulse.look(now)
        pulse.heard(now, last=False)
    pulse.look(9.0)  # stood still from 1.0 to 9.0
    assert not pulse.stopped(9.0) and pulse.silent_for(9.0) == 0.0
    for now in (9.5, 10.5, 11.5, 12.5):
        pulse.look(now)
    assert not pulse.stopped(12.5)
    pulse.look(13.0)
    assert pulse.stopped(13.0)  # silent for the timeout since it came back: named as ever
    steady = Pulse(timeout=4.0, started=0.0)
    for now in (0.0, 1.0, 2.0, 3.0, 4.0):  # looks a second apart (a tick): no stall of its own
        steady.look(now)
    assert steady.stopped(4.0)


def test_a_rank_that_has_ended_is_never_stopped_and_the_watch_finishes_with_both_ends() -> None:
    pulse = Pulse(timeout=1.0, started=0.0)
    pulse.heard(0.5, last=True)
    assert not pulse.stopped(1000.0)
    assert not pulse.finished()  # this rank has not sent its own last pulse
    pulse.ending(2.0)
    assert pulse.finished()


def test_a_rank_still_beating_is_alive_however_long_it_takes_to_end() -> None:
    # Its last work may be long (writer threads draining, a slow filesystem): only silence names it.
    pulse = Pulse(timeout=2.0, started=0.0)
    pulse.ending(10.0)
    for now in (10.5, 12.0, 13.5, 100.0):
        pulse.heard(now, last=False)
        assert not pulse.stopped(now + 1.9)
    assert pulse.stopped(102.0) and not pulse.finished()


@given(
    timeout=st.floats(min_value=1.0, max_value=100.0),
    gaps=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=50),
)
def test_pulses_closer_than_the_timeout_never_make_a_stop(timeout: float, gaps: list[float]) -> None:
    pulse = Pulse(timeout=timeout, started=0.0)
    now = 0.0
    for gap in gaps:
        now += gap * timeout * 0.999
        assert not pulse.stopped(now)
        pulse.heard(now, last=False)
    assert pulse.stopped(now + timeout * 1.001)


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Pulse(timeout=0.0, started=0.0)


@pytest.mark.parametrize("seconds", [0.5, -1.0, float("nan"), float("inf"), 86401.0, None, "30"])
def test_peer_timeout_out_of_range_is_refused(seconds: object) -> None:
    with pytest.raises(UsageError, match="--peer-timeout must be 0 \\(off\\) or at least 1"):
        Config(source="/s", dest="/d", peer_timeout=seconds).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("seconds", [0.0, 1.0, 30.0, 86400.0])
def test_peer_timeout_in_range_or_off_is_accepted(seconds: float) -> None:
    assert Config(source="/s", dest="/d", peer_timeout=seconds).validate().peer_timeout == seconds


def test_the_pulse_thread_runs_on_a_real_mpi_and_ends_with_its_last_pulse() -> None:
    # COMM_SELF: the one rank is its own neighbour, so it hears its own pulses and its own end.
    from mpi4py import MPI

    stopped: list[PeerStoppedError] = []
    alive = liveness.Liveness(MPI.COMM_SELF, 1.0, on_stopped=lambda comm, error: stopped.append(error))
    time.sleep(1.5)  # longer than the timeout: only pulses keep it from naming the rank
    assert alive.pulse.last_heard is not None and alive.pulse.silent_for(time.monotonic()) < 1.0
    started = time.monotonic()
    alive.stop()
    assert time.monotonic() - started < 0.5
    assert alive.pulse.finished() and stopped == []
    assert not any(thread.name == "azcp-pulse" for thread in threading.enumerate())


class _Mute(liveness.Liveness):
    """A rank whose pulses never leave it (as if it had stopped before the first)."""

    def _send(self, last: bool) -> Any:
        from mpi4py import MPI

        return MPI.REQUEST_NULL


def test_a_silent_rank_is_handed_to_on_stopped_naming_it() -> None:
    # COMM_SELF: the rank watches itself, and sends nothing.
    from mpi4py import MPI

    seen: list[tuple[Any, PeerStoppedError]] = []
    named = threading.Event()

    def on_stopped(comm: Any, error: PeerStoppedError) -> None:
        seen.append((comm, error))
        named.set()

    started = time.monotonic()
    mute = _Mute(MPI.COMM_SELF, 1.0, on_stopped=on_stopped)
    assert named.wait(5)
    assert 1.0 <= time.monotonic() - started < 2.5  # named after the timeout, not long after
    mute._thread.join(5)
    ((comm, error),) = seen
    # The run's own communicator is what a stop ends, not the pulse's duplicate (MPICH's abort of
    # another communicator than the world waits on every rank of it, the stopped one too).
    assert comm is MPI.COMM_SELF and mute.comm is not comm
    assert error.exit_code == 10 and error.rank == 0
    line = error.one_line()
    assert line.startswith("azcp-cluster: error [peer]: rank 0: sent nothing for 1 s") and "--peer-timeout 1" in line
    mute.comm.Free()


def test_a_rank_that_leaves_alone_stops_at_once_waiting_for_nobody() -> None:
    # One rank's unexpected error (not agreed): no last pulse, no wait (the CLI ends the job).
    from mpi4py import MPI

    stopped: list[PeerStoppedError] = []
    mute = _Mute(MPI.COMM_SELF, 30.0, on_stopped=lambda comm, error: stopped.append(error))
    started = time.monotonic()
    mute.stop(handshake=False)
    assert time.monotonic() - started < 1.0
    assert not mute.pulse.finished() and stopped == []


def test_no_pulse_for_one_rank_no_timeout_or_no_threads() -> None:
    from mpi4py import MPI

    assert liveness.start(MPI.COMM_SELF, 30.0) is None  # one rank: nobody to watch
    assert liveness.start(MPI.COMM_WORLD, None) is None


def test_a_rank_whose_before_is_ending_the_job_names_nobody() -> None:
    """The rank before named its own before and is ending the job: the silence that follows is
    that ending, and the one line is its to say (Open MPI in the box printed two, the second
    naming the rank that was ending the job)."""
    pulse = Pulse(5.0, 0.0)
    pulse.heard(1.0, last=False, naming=True)
    assert pulse.named_before and not pulse.heard_end and not pulse.stopped(5.9) and pulse.stopped(6.0)
    pulse.heard(7.0, last=False)
    assert pulse.named_before  # once said, it stands


class _Naming(liveness.Liveness):
    """A rank whose only message is the word that it is ending the job (to itself: COMM_SELF)."""

    def _send(self, last: bool) -> Any:
        from mpi4py import MPI

        if self.pulse.last_sent is None:
            return self.comm.Isend(liveness._NAMING, dest=self.after, tag=liveness._PULSE_TAG)
        return MPI.REQUEST_NULL


def test_the_watcher_of_a_rank_that_was_ending_the_job_ends_quietly() -> None:
    from mpi4py import MPI

    seen: list[PeerStoppedError] = []
    named = threading.Event()

    def on_stopped(comm: Any, error: PeerStoppedError) -> None:
        seen.append(error)
        named.set()

    quiet = _Naming(MPI.COMM_SELF, 1.0, on_stopped=on_stopped)
    assert named.wait(5)
    quiet._thread.join(5)
    (error,) = seen
    assert error.quiet and error.exit_code == 10 and quiet.pulse.named_before
    quiet.comm.Free()
    loud = _Mute(MPI.COMM_SELF, 1.0, on_stopped=lambda comm, error: seen.append(error))
    loud._thread.join(5)
    assert not seen[-1].quiet  # no word from the rank before: this watcher's line is the one
    loud.comm.Free()
