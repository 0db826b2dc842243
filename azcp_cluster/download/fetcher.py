"""What a rank's download is asked and answers: the :class:`Fetcher` interface, the
:class:`LandingSink` it tells as blocks land, and its :class:`DownloadStats`.

Apart from the requests themselves (downloader.py) because every way of fetching shares
them: :class:`~azcp_cluster.download.downloader.Downloader` in the rank, the worker
processes and the auto mode (workers.py), and the stages that drive them. The blocks
themselves (what a ranged GET is, how shards are cut into them) are pure arithmetic:
:mod:`azcp_cluster.core.blocks`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from azcp_cluster.core.blocks import Block


@dataclass
class DownloadStats:
    """What one rank's download did."""

    bytes: int = 0
    requests: int = 0
    retries: int = 0
    retry_causes: Counter[str] = field(default_factory=Counter)
    direct_refused: str = ""  # a path whose filesystem refused O_DIRECT, if any
    worker_bytes: list[int] = field(default_factory=list)  # by download worker process (workers.py)


@dataclass(frozen=True)
class LandingSink:
    """Who is told as a download's blocks land: composed once by the stage that runs the
    download and given to the downloader when it is made (never set on it afterwards).

    Each block, once all its bytes are written: first its bytes to ``progress`` (the progress
    bar), then the block to ``journal`` (the block journal: ``(file, offset, length, crc)``,
    the CRC-32 of its bytes as they came from the source), then to ``notice`` (streaming: the
    fan-out learns that its bytes are on the node), or, in a download worker process, the
    block and its CRC to ``report`` (its rank is told, and tells its own sink); and with
    ``--verify``, the block and its CRC to ``hashes`` (the run's source pieces,
    core.crc.SourcePieces). Called on the thread that runs the download.
    """

    progress: Callable[[int], None] | None = None
    journal: Callable[[int, int, int, int], None] | None = None
    notice: Callable[[Block], None] | None = None
    report: Callable[[Block, int], None] | None = None
    hashes: Callable[[int, int, int, int], None] | None = None

    def add_bytes(self, nbytes: int) -> None:
        """A block's ``nbytes`` body bytes are written."""
        if self.progress is not None:
            self.progress(nbytes)

    def landed(self, block: Block, crc: int) -> None:
        """``block`` is whole on the disk (its writes done, not yet durable); ``crc``: the
        CRC-32 of its bytes as they arrived."""
        if self.journal is not None:
            self.journal(block.file, block.offset, block.length, crc)
        if self.notice is not None:
            self.notice(block)
        if self.report is not None:
            self.report(block, crc)
        if self.hashes is not None:
            self.hashes(block.file, block.offset, block.length, crc)


class Fetcher(Protocol):
    """The downloader interface: what fetches a rank's blocks, in the rank
    (:class:`~azcp_cluster.download.downloader.Downloader`) or over worker processes
    (:class:`~azcp_cluster.download.workers.WorkerDownloader`,
    :class:`~azcp_cluster.download.workers.AutoDownloader`).

    What it tells (its :class:`LandingSink`) and when it stops (``peer_failed``) are given
    when it is made; ``stats`` is live, also after a failure.
    """

    @property
    def stats(self) -> DownloadStats:
        """What was fetched so far."""

    def run(self, blocks: Sequence[Block]) -> DownloadStats:
        """Fetch every block; raise DownloadError (or PeerFailed) on failure."""
