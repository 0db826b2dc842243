"""Every rank's pulse on a thread of its own; a rank that stops ends the job (``--peer-timeout``).

The schedule and the decision are :class:`azcp_cluster.core.pulse.Pulse`'s; this module sends
and receives the pulses over a duplicate of the run's communicator, each rank to the next in
rank order (the last to rank 0), so every rank is watched by exactly one other. It runs on a
thread because a rank's main thread may be busy for long (a download, a disk write), and MPI
calls release the interpreter's lock, so the pulse never waits on the work. A process that
stops (SIGSTOP, a debugger, a frozen node) stops its pulse thread too: that is what is seen.

When the rank before has been silent for the timeout, the watcher prints one line naming it and
ends the job with exit code 10 (:class:`azcp_cluster.core.errors.PeerStoppedError`) through
:func:`azcp_cluster.run.ending.end_job`: ``MPI_Abort`` on the run's communicator (not the pulse's
duplicate: MPICH aborts another communicator than the world by sending to each of its ranks and
waiting, for ever with one stopped), and this process's own exit if that has not ended it
within :data:`~azcp_cluster.run.ending.ABORT_GRACE`. The launcher then ends every rank, the
stopped one too (SIGKILL ends a stopped process). Nothing has been renamed before every rank
agreed on every byte, so a rerun finishes the copy.

Only under an MPI started with ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it; a host program of
the Python API may not have): otherwise there is no pulse, as with a timeout of 0.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import numpy as np

from azcp_cluster.core.comm import Comm, Request
from azcp_cluster.core.errors import PeerStoppedError
from azcp_cluster.core.pulse import Pulse
from azcp_cluster.run.ending import end_job
from azcp_cluster.run.mpi import threads_allowed

_PULSE_TAG = 7072
_BEAT = np.zeros(1, dtype=np.uint8)  # a pulse
_LAST = np.ones(1, dtype=np.uint8)  # the last pulse: this rank has ended
_NAMING = np.full(1, 2, dtype=np.uint8)  # this rank named the one before it and is ending the job
# How long a watcher that names a rank waits for the next rank to take its word, before it ends
# the job: the next rank's watcher would otherwise see this rank fall silent and name it too.
NAMING_WAIT = 0.5
END_TICK = 0.005  # seconds between looks once this rank has ended (the run waits on them)


def abort_job(comm: Comm, error: PeerStoppedError) -> None:
    """Say ``error``'s one line and end every rank of ``comm`` with its exit code (never returns)."""
    end_job(comm.Abort, error.exit_code, "" if error.quiet else error.one_line())


class Liveness:
    """This rank's pulse to the next rank and its watch over the one before (a daemon thread).

    Collective: every rank of ``comm`` creates it at the same point (it duplicates ``comm``),
    and every rank calls :meth:`stop` at the end of its run. ``on_stopped`` gets ``comm`` itself
    (the one to abort) and the error naming the silent rank.
    """

    def __init__(
        self,
        comm: Comm,
        timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_stopped: Callable[[Comm, PeerStoppedError], None] = abort_job,
    ) -> None:
        self.job = comm  # what a stop ends
        self.comm = comm.Dup()  # the pulses' own
        self.rank: int = self.comm.Get_rank()
        size: int = self.comm.Get_size()
        self.after = (self.rank + 1) % size
        self.before = (self.rank - 1) % size
        self.clock = clock
        self.on_stopped = on_stopped
        self.pulse = Pulse(timeout, clock())
        self._ending = threading.Event()
        self._leaving = False  # stop() without the last pulses
        self._thread = threading.Thread(target=self._run, name="azcp-pulse", daemon=True)
        self._thread.start()

    def stop(self, handshake: bool = True) -> None:
        """Send the last pulse; return once the rank before has sent its own (or has been named
        stopped). ``handshake=False``: stop beating at once, waiting for nobody (this rank
        leaves alone; should the job go on, its watcher names it)."""
        self._leaving = not handshake
        self._ending.set()
        self._thread.join()
        self.comm.Free()

    def _send(self, last: bool) -> Request:
        """Start sending a pulse to the next rank; the last one synchronously (complete once received)."""
        if last:
            return self.comm.Issend(_LAST, dest=self.after, tag=_PULSE_TAG)
        return self.comm.Isend(_BEAT, dest=self.after, tag=_PULSE_TAG)

    def _run(self) -> None:
        # SIGINT and SIGTERM go to the main thread, where the recorder runs and the blocking
        # calls they must interrupt are.
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
        pulse, comm = self.pulse, self.comm
        inbox = np.zeros(1, dtype=np.uint8)
        receive = comm.Irecv(inbox, source=self.before, tag=_PULSE_TAG)
        sends: list[Request] = []
        while True:
            now = self.clock()
            pulse.look(now)
            if self._leaving:
                if not pulse.heard_end:
                    receive.Cancel()
                    receive.Wait()
                return  # sends of beats complete locally (eager); nobody waits on them
            if self._ending.is_set() and pulse.ending_since is None:
                sends.append(self._send(last=True))
                pulse.ending(now)
            elif pulse.send_due(now):
                sends.append(self._send(last=False))
                pulse.sent(now)
            while not pulse.heard_end and receive.Test():
                value = int(inbox[0])
                pulse.heard(now, last=value == 1, naming=value == 2)
                if not pulse.heard_end:
                    receive = comm.Irecv(inbox, source=self.before, tag=_PULSE_TAG)
            sends = [request for request in sends if not request.Test()]
            if pulse.finished() and not sends:
                return
            if pulse.stopped(now):
                why = (
                    f"sent nothing for {pulse.silent_for(now):.0f} s (stopped, frozen or cut off: "
                    f"--peer-timeout {pulse.timeout:g}); the job is ended"
                )
                if not pulse.heard_end:  # nothing is left posted (where on_stopped does not end the process)
                    receive.Cancel()
                    receive.Wait()
                error = PeerStoppedError(why, rank=self.before)
                error.quiet = pulse.named_before  # the rank before is ending the job: its line is the one
                self._tell_next()
                self.on_stopped(self.job, error)
                return
            if self._ending.is_set():  # ending: the others end at about the same time
                time.sleep(min(pulse.tick, END_TICK))
            else:
                self._ending.wait(pulse.tick)

    def _tell_next(self) -> None:
        """Tell the next rank that this one is ending the job (so its watcher names nobody for the
        silence that follows), waiting at most NAMING_WAIT for the word to leave."""
        if self.after == self.rank:
            return
        request = self.comm.Isend(_NAMING, dest=self.after, tag=_PULSE_TAG)
        deadline = self.clock() + NAMING_WAIT
        while not request.Test() and self.clock() < deadline:
            time.sleep(END_TICK)


def start(comm: Comm, timeout: float | None) -> Liveness | None:
    """The pulse for a run over ``comm`` (collective), or None: one rank, no timeout, or no threads in MPI."""
    if timeout is None or comm.Get_size() < 2 or not threads_allowed():
        return None
    return Liveness(comm, timeout)


__all__ = ["Liveness", "abort_job", "start"]
