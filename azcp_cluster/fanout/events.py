"""The fan-out driver's vocabulary: what happens (typed events, each one call of the pure
:class:`azcp_cluster.core.fanout.FanOut`), what a streaming download tells it (:class:`LandingFeed`),
what it tells its stage (:class:`StageHooks`) and what one rank's fan-out did
(:class:`FanOutStats`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from azcp_cluster.core.errors import AzcpError, InternalError
from azcp_cluster.run.cluster import redact


@dataclass
class FanOutStats:
    """What one rank's fan-out did."""

    sent_bytes: int = 0
    received_bytes: int = 0
    chunks: int = 0  # transfers this rank took part in
    source_bytes: int = 0  # bytes read from a local SOURCE
    memory_bytes: int = 0  # streaming: bytes sent from the download's buffers, not read back from the disk
    direct_refused: str = ""  # a path whose filesystem refused O_DIRECT, if any


class HeldBlocks(Protocol):
    """Streaming: blocks this rank's own download wrote and still holds in its buffers
    (``writepool.WritePool``), for the read-ahead to copy instead of reading the disk; called on
    the read-ahead thread. *Held* is memory only: what a stopped run left on the disk is
    ``dest.journal.Kept``."""

    def copy_held(self, file: int, offset: int, out: np.ndarray) -> bool:
        """Copy ``len(out)`` bytes of ``file`` from ``offset`` into ``out``; False when they are not
        all held (they are read from the disk)."""


class LandingFeed(Protocol):
    """Streaming: the feed of what the download has put on this node so far, transfer by
    transfer (polled on the MPI thread). A block *lands* when its bytes are written on this node;
    this says which transfers rooted here have all theirs."""

    def waits(self, seq: int) -> bool:
        """Whether transfer ``seq`` (rooted here) must wait for downloaded bytes."""

    def poll(self) -> list[int]:
        """The transfers rooted here whose bytes have all landed since the last poll."""

    def failed(self) -> AzcpError | None:
        """This rank's own download error, if any (a peer's shows in ``peer_failed``)."""


def _no_progress(nbytes: int, files: int) -> None:
    """Nobody counts the transfers."""


def _never() -> bool:
    """No other rank is watched."""
    return False


def _nobody() -> None:
    """Nobody is told."""


@dataclass(frozen=True)
class StageHooks:
    """What one fan-out run tells the stage that runs it, and asks it: composed once by the
    stage and given to :meth:`~azcp_cluster.fanout.driver.FanOutDriver.run` (the driver
    is made earlier, at allocation; the stage's progress bar and outcome exist only once the
    stage has begun). Called on the driver's (the MPI) thread.
    """

    # (bytes, files complete) per transfer done here: the stage's tally and progress bar.
    on_bytes: Callable[[int, int], None] = _no_progress
    # Streaming: another rank's failure (a downloader of this node, say) seen before the
    # next agreement, so a root stops waiting for bytes that will not come.
    peer_failed: Callable[[], bool] = _never
    # Called once when this rank fails: tells every other rank at once (the failure
    # signal), so a root waiting for bytes from a download elsewhere, and the downloads
    # themselves, stop before the next agreement.
    announce: Callable[[], None] = _nobody


NO_HOOKS = StageHooks()  # a run nobody watches (tests, and programs that drive the fan-out alone)


# -- what happens, as the driver tells the machine ----------------------------------------


@dataclass(frozen=True)
class ReadDone:
    """The read-ahead filled transfer ``seq``'s slot (or failed: ``error``)."""

    seq: int
    error: AzcpError | None = None


@dataclass(frozen=True)
class WriteDone:
    """A writer or the hasher finished one job of transfer ``seq`` (or failed: ``error``)."""

    seq: int
    error: AzcpError | None = None


@dataclass(frozen=True)
class CallDone:
    """The oldest transfer in flight completed; ``intact``: the byte its root sent with it."""

    intact: bool


@dataclass(frozen=True)
class Agreed:
    """The agreement ended; ``any_failed``: some rank failed."""

    any_failed: bool


@dataclass(frozen=True)
class LandedHere:
    """Streaming: transfer ``seq``'s bytes are all on this node."""

    seq: int


@dataclass(frozen=True)
class Failed:
    """This rank failed (``error``), or learnt that another one did (None)."""

    error: AzcpError | None


Event = ReadDone | WriteDone | CallDone | Agreed | LandedHere | Failed


def as_error(error: BaseException | None, what: str) -> AzcpError | None:
    """A thread's failure in the project's tree (an unexpected one named by the thread's task)."""
    if error is None or isinstance(error, AzcpError):
        return error
    return InternalError(f"{what} failed: {type(error).__name__}: {redact(str(error))}")
