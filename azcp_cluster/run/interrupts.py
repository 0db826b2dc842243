"""SIGINT and SIGTERM: recorded when they come, turned into an agreed error where it is safe.

A signal can reach a rank anywhere, also in the middle of the broadcast, where a rank that
left early would leave the others waiting in broadcasts it never joins. So the handler only
records the first signal, and the stages turn it into the rank's error at points where all
ranks can stop together: every agreement (:meth:`Cluster.conclude`), the broadcast's chunk
loop (its every-16-chunks check then stops all ranks at the same chunk), and the download's
0.1 s poll (the existing failure signal then stops the others). Only inside sections that
are safe to abandon (listing, hashing, the verify read-back: :meth:`Interrupts.abandonable`)
does the handler raise at once.

Only the command line installs the handlers (``cli.main``), and it restores the previous
ones when the run ends; the Python API never does, since the host program's handlers are
its own. Later signals after the first are counted and ignored: a terminal's Ctrl-C can
reach a rank both directly and through ``mpiexec``, and the second must not kill it.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from azcp_cluster.core.errors import Interrupted, SigintError, SigtermError

TYPE_CHECKING = False  # typing costs an import the command makes before its handlers are in
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType
    from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)
_ERRORS: dict[int, type[Interrupted]] = {signal.SIGINT: SigintError, signal.SIGTERM: SigtermError}


def shield() -> None:
    """Block SIGINT and SIGTERM in the calling worker thread (no-op on the main thread).

    The kernel then delivers them to the main thread, where Python runs the handler anyway.
    A worker blocked in ``queue.SimpleQueue.get`` that a signal interrupts could otherwise
    hang or wake wrongly (CPython 3.11's SimpleQueue treats an interrupted wait as a taken
    lock); so could the main thread in a timed ``SimpleQueue.get``, which is why the
    broadcast's MPI thread naps and polls instead. Every thread the tool starts calls this
    first (or is started with it as the pool's initializer).
    """
    if threading.current_thread() is not threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)


def signal_error(signum: int, rank: int | None = None) -> Interrupted:
    """The error that reports ``signum`` (SIGINT: exit 130, SIGTERM: exit 143)."""
    cls = _ERRORS.get(signum, SigintError)
    return cls(
        f"stopped by {cls.signal_name}; files not yet complete stay under their temporary names, "
        "a rerun finishes the copy",
        rank=rank,
    )


class Interrupts:
    """Records the first SIGINT or SIGTERM this process receives (once :meth:`install`-ed).

    One that is never installed never fires: the default for the Python API and the tests.
    """

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.received = 0  # how many, the ignored later ones included
        self._previous: dict[int, Any] = {}
        self.rank: int | None = None  # named by the errors unless told otherwise (Cluster sets it)
        self._abandonable = 0  # depth of the sections the handler may abandon
        self._rank: int | None = None  # the rank named by an error raised inside a section
        self._sealed = False  # the copy is complete: a later signal changes nothing
        self._mask: set[int | signal.Signals] = set()  # the thread's signal mask before install()
        # Called with the first signal's number, in the handler: rank 0 writes its JSON report
        # there, since a launcher may kill every rank before they agree to stop (MPICH's second
        # Ctrl-C at once, Open MPI's SIGKILL 0.25 s after its SIGTERM). Must not raise.
        self.on_first: Callable[[int], None] | None = None

    # -- handlers -------------------------------------------------------------------------

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on (main thread only; elsewhere a no-op).

        Both are unblocked too: the ``azcp-cluster`` command starts the interpreter with them
        blocked (bin/azcp-cluster), so one that came during its start-up is recorded now.
        """
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            # None: a handler not installed from Python; the default is the closest.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if previous:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)  # blocked again, if they were

    @contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """:meth:`install` for the duration of a ``with`` block, then :meth:`restore`."""
        self.install()
        try:
            yield self
        finally:
            self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.signum is not None or self._sealed:
            return  # only the first one counts, and none once the copy is complete
        self.signum = signum
        hook, self.on_first = self.on_first, None
        if hook is not None:
            hook(signum)
        if self._abandonable:
            raise signal_error(signum, self._rank)

    def seal(self) -> None:
        """The copy is decided: from now on a signal is counted and ignored, also one recorded since
        the last agreement (no rank has acted on it), and the run ends with 0."""
        self._sealed = True
        self.on_first = None

    @property
    def stopping(self) -> bool:
        """Whether a signal is to stop the run: one was received and the copy is not sealed."""
        return self.signum is not None and not self._sealed

    # -- for the stages -------------------------------------------------------------------

    def error(self, rank: int | None = None) -> Interrupted | None:
        """The error to raise for the signal received, or None if none was (or the copy is sealed)."""
        if self.signum is None or self._sealed:
            return None
        return signal_error(self.signum, self.rank if rank is None else rank)

    @contextmanager
    def abandonable(self, rank: int | None = None) -> Iterator[None]:
        """A section that a signal may stop at any point: the handler raises the error at once.

        Only for rank-local work that holds no collective half-entered and whose results
        are thrown away with it (listing, hashing, reading back). A signal received before
        the section stops it before it starts.
        """
        rank = self.rank if rank is None else rank
        pending = self.error(rank)
        if pending is not None:
            raise pending
        self._abandonable += 1
        self._rank = rank
        try:
            yield
        finally:
            self._abandonable -= 1


__all__ = ["HANDLED", "Interrupts", "signal_error"]
