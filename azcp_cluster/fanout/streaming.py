"""The streaming stage: download and fan-out at once, each transfer sent as soon as its bytes land.

Roles (see ``docs/architecture.md``, "Streaming"):

* a node's **leader** runs the fan-out on its main thread (:class:`FanOutDriver`, the only
  thread of the rank that makes MPI calls) and, when it downloads too, its own download
  on a second thread (its event loop makes no MPI call: a failure elsewhere reaches it
  through a flag the main thread sets);
* a node's other **downloaders** download on their main thread and tell their leader,
  one small message per ranged GET over the node's communicator, which blocks landed
  (:class:`Notifier`), then one last message when they stop, whatever the reason;
* the leader's :class:`LandingFeed` turns those notices (and its own thread's) into "the
  bytes of transfer ``seq`` are on this node" for the state machine
  (:class:`azcp_cluster.core.schedule.Landing` does the counting).

Every rank derives the same blocks in the same order from the plan, so a notice is one
integer: the block's index in its node's list.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from azcp_cluster.core.blocks import Block
from azcp_cluster.core.comm import Comm, Request
from azcp_cluster.core.errors import AzcpError
from azcp_cluster.core.schedule import Landing, Transfer
from azcp_cluster.download.fetcher import DownloadStats, Fetcher
from azcp_cluster.fanout.driver import FanOutDriver
from azcp_cluster.fanout.events import FanOutStats, HeldBlocks, StageHooks
from azcp_cluster.run.cluster import PeerFailed, as_azcp_error
from azcp_cluster.run.interrupts import shield

# The tag of landing notices on a node's communicator.
LANDED_TAG = 23
# The notice a downloader sends last: it will send no more.
END = -1


# A notice on the node's communicator: (the sender's group rank, block indices or END).
Notice = tuple[int, list[int]]


# The node's communicator, as the landing notices use it (its leader is rank 0), and a send's request.
NodeComm = Comm
SendRequest = Request


class LandingFeed:
    """A leader's view of what its node's downloads have landed (implements ``events.LandingFeed``).

    ``group_comm`` is the node's communicator (the leader is its rank 0); ``others`` the
    group ranks of the node's other downloaders. The leader's own download thread reports
    through :meth:`local` (thread-safe); everything else runs on the main thread.
    """

    def __init__(self, landing: Landing, group_comm: NodeComm, others: Sequence[int]) -> None:
        self.landing = landing
        self.comm = group_comm
        self.others = set(others)
        self.ended: set[int] = set()  # downloaders that sent END
        self._local: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._ready: list[int] = landing.ready()
        self._error: AzcpError | None = None

    def local(self, index: int) -> None:
        """From the leader's download thread: block ``index`` is on the disk."""
        self._local.put(index)

    def local_failed(self, error: AzcpError) -> None:
        """From the leader's download thread: it failed."""
        self._error = error

    def waits(self, seq: int) -> bool:
        """Whether transfer ``seq`` waits for downloaded bytes (once; later ones are reported by poll)."""
        return self.landing.waits.get(seq, 0) > 0

    def poll(self) -> list[int]:
        """Transfers whose bytes have all landed since the last poll (never blocks)."""
        ready, self._ready = self._ready, []
        while True:
            try:
                index = self._local.get_nowait()
            except queue.Empty:
                break
            ready += self.landing.landed(index)
        while self.others - self.ended:
            if not self.comm.iprobe(tag=LANDED_TAG):
                break
            ready += self._take(cast(Notice, self.comm.recv(tag=LANDED_TAG)))
        return ready

    def failed(self) -> AzcpError | None:
        """The leader's own download error, if any."""
        return self._error

    def finish(self) -> None:
        """Receive the notices still coming, up to every other downloader's END (the node's
        communicator must be empty before it is freed or used again)."""
        while self.others - self.ended:
            self._take(cast(Notice, self.comm.recv(tag=LANDED_TAG)))

    def _take(self, message: Notice) -> list[int]:
        sender, indices = message
        ready: list[int] = []
        for index in indices:
            if index == END:
                self.ended.add(sender)
            else:
                ready += self.landing.landed(index)
        return ready


class Notifier:
    """A node's downloader (not its leader): tells the leader which blocks have landed.

    Called on the rank's main thread (its event loop), so it may use MPI. Notices are
    non-blocking sends of a few bytes; :meth:`close` sends END and completes them all.
    """

    def __init__(self, group_comm: NodeComm, node_index: dict[tuple[int, int], int]) -> None:
        self.comm = group_comm
        self.me = group_comm.Get_rank()
        self.node_index = node_index  # (file, offset) -> the block's node-wide index
        self._requests: list[SendRequest] = []

    def landed(self, block: Block) -> None:
        """``block`` is on the disk (the download's landing sink's notice)."""
        self._send([self.node_index[(block.file, block.offset)]])

    def close(self) -> None:
        """The last notice: no more will come. Waits until every notice has been sent."""
        self._send([END])
        for request in self._requests:
            request.wait()
        self._requests = []

    def _send(self, indices: list[int]) -> None:
        self._requests.append(self.comm.isend((self.me, indices), dest=0, tag=LANDED_TAG))
        # Completed sends are dropped as we go: a long download sends thousands.
        if len(self._requests) > 64:
            self._requests = [r for r in self._requests if not r.Test()]


class DownloadThread:
    """A leader's own download, on a thread of its own while the main thread runs the fan-out.

    ``stop`` is set by the main thread; the download was made with ``stop.is_set`` as its
    ``peer_failed`` (its event loop makes no MPI call).
    """

    def __init__(self, run: Callable[[], DownloadStats], rank: int, stop: threading.Event) -> None:
        self.rank = rank  # named by an unexpected error's message
        self.stop = stop
        self.result: DownloadStats | None = None
        self.error: BaseException | None = None
        self._run = run
        self._thread = threading.Thread(target=self._main, name="azcp-download", daemon=True)

    def start(self) -> None:
        """Start downloading."""
        self._thread.start()

    def wait(self) -> tuple[DownloadStats | None, BaseException | None]:
        """Wait for the download to end: its result, and its error (None, PeerFailed when it was
        stopped, or the download's own)."""
        self._thread.join()
        return self.result, self.error

    def _main(self) -> None:
        shield()
        try:
            self.result = self._run()
        except AzcpError as exc:
            self.error = exc
        except BaseException as exc:  # handed to the main thread, which decides
            # The same redacted one-liner as anywhere else (a URL's SAS never shows).
            self.error = exc if isinstance(exc, PeerFailed) else as_azcp_error(exc, self.rank)


@dataclass(frozen=True)
class Streamed:
    """What one rank's part of the streaming stage gives the next stages."""

    downloaded: float  # seconds from the stage's start to the end of this rank's download (0: none)
    download: DownloadStats | None = None  # if this rank downloaded
    fanout: FanOutStats | None = None  # if this rank is a leader
    digests: dict[int, str] | None = None  # --verify stream: MD5 of the files hashed in flight


def lead(
    driver: FanOutDriver,
    schedule: Sequence[Transfer],
    feed: LandingFeed,
    downloader: Fetcher | None,
    blocks: Sequence[Block],
    since: Callable[[], float],
    rank: int,
    stop: threading.Event,
    hooks: StageHooks,
    failed: AzcpError | None = None,
    held: HeldBlocks | None = None,
) -> Streamed:
    """A leader's part: the fan-out on this (the MPI) thread, its own ``blocks`` (if any) downloaded
    by ``downloader`` on a thread meanwhile. ``since()``: seconds since the stage began.

    ``downloader`` was made telling ``feed`` of each block it lands (its landing sink) and
    stopping once ``stop`` is set (its ``peer_failed``), which this sets when the fan-out
    stops. ``hooks``: the stage's, for the fan-out. ``failed``: the download could not be
    set up; the fan-out still runs to its first agreement. ``held``: the download's buffers,
    which hold what it landed until the fan-out copies it (its transfers are then sent from
    memory, not read back from the disk).

    Raises the stage's error: the fan-out's, or this rank's own download error rather than a
    peer's failure when both happened.
    """
    fetch = None  # this rank's own download, if it has blocks and could set it up
    if downloader is not None and blocks and failed is None:
        fetch = _TimedFetch(downloader, blocks, feed, since, rank)
    thread = _download_aside(fetch, rank, stop, feed) if fetch is not None else None
    fanout, dstats, failure = _fan_out_beside(driver, schedule, hooks, feed, failed, held, thread)
    if failure is not None:
        raise failure  # after every byte was sent: the download's own end failed
    return Streamed(fetch.downloaded if fetch is not None else 0.0, dstats, fanout, dict(driver.digests))


class _TimedFetch:
    """A leader's own download as its thread runs it: ``fetcher.run(blocks)``, with the stage's
    seconds when it ended (:attr:`downloaded`, 0 until then), and any failure but a stop told
    to ``feed``, so that the fan-out fails with it (a bug as much as a download error: a thread
    that just ended would leave its transfers waiting for ever)."""

    def __init__(
        self, fetcher: Fetcher, blocks: Sequence[Block], feed: LandingFeed, since: Callable[[], float], rank: int
    ) -> None:
        self.fetcher, self.blocks, self.feed, self.since, self.rank = fetcher, blocks, feed, since, rank
        self.downloaded = 0.0

    def __call__(self) -> DownloadStats:
        """Download the blocks (on the download thread)."""
        try:
            return self.fetcher.run(self.blocks)
        except PeerFailed:
            raise  # stopped: the fan-out stopped first
        except BaseException as exc:
            self.feed.local_failed(as_azcp_error(exc, self.rank))
            raise
        finally:
            self.downloaded = self.since()


def _download_aside(
    fetch: Callable[[], DownloadStats], rank: int, stop: threading.Event, feed: LandingFeed
) -> DownloadThread | None:
    """``fetch`` started on a thread of its own, or None where no thread can be started (a
    process limit): ``feed`` is told, and the fan-out fails at its next agreement."""
    thread = DownloadThread(fetch, rank, stop)
    try:
        thread.start()
    except Exception as exc:
        feed.local_failed(as_azcp_error(exc, rank))
        return None
    return thread


def _fan_out_beside(
    driver: FanOutDriver,
    schedule: Sequence[Transfer],
    hooks: StageHooks,
    feed: LandingFeed,
    failed: AzcpError | None,
    held: HeldBlocks | None,
    thread: DownloadThread | None,
) -> tuple[FanOutStats | None, DownloadStats | None, BaseException | None]:
    """The fan-out on this thread while ``thread`` (if any) downloads, then the download's end:
    the fan-out's stats, the download's, and the download's error (its own, or PeerFailed).

    A fan-out that fails stops the download and waits for it; a peer's failure is raised as
    this rank's own download error if it has one (the cause here, not a peer's)."""
    fanout = None
    dstats = None
    failure: BaseException | None = None
    try:
        fanout = driver.run(schedule, hooks, feed=feed, failed=failed, held=held)
    except PeerFailed:
        if thread is not None:
            thread.stop.set()
            dstats, failure = thread.wait()
            thread = None
            if isinstance(failure, AzcpError):
                raise failure from None  # this rank's own download failed as well: its error
        raise
    finally:
        if thread is not None:
            if fanout is None:
                thread.stop.set()  # the fan-out stopped (its error is the stage's): so does the download
            dstats, failure = thread.wait()
    return fanout, dstats, failure


def notify_while_downloading(
    group_comm: NodeComm,
    index: dict[tuple[int, int], int],
    make_downloader: Callable[[Callable[[Block], None]], Fetcher],
    blocks: Sequence[Block],
    since: Callable[[], float],
) -> Streamed:
    """A node's other downloader: fetch ``blocks``, telling the leader of each as it lands.

    ``make_downloader(notice)``: this rank's downloader, ``notice`` in its landing sink. The
    END goes out whatever happens (the leader waits for it): the notifier is made first.
    """
    notifier = Notifier(group_comm, index)
    downloaded = 0.0
    try:
        downloader = make_downloader(notifier.landed)
        dstats = downloader.run(blocks)
    finally:
        downloaded = since()
        notifier.close()
    return Streamed(downloaded, dstats)


__all__ = [
    "END",
    "LANDED_TAG",
    "DownloadThread",
    "LandingFeed",
    "NodeComm",
    "Notifier",
    "SendRequest",
    "Streamed",
    "lead",
    "notify_while_downloading",
]
