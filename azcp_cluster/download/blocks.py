"""What a rank's download is asked and answers: blocks (ranged GETs), stats, and the Fetcher protocol.

Apart from the requests themselves (downloader.py) because every way of fetching shares
them: :class:`~azcp_cluster.download.downloader.Downloader` in the rank, the worker
processes and the auto mode (workers.py), the streaming stage that waits for blocks to land,
and the allocation that sizes the buffers by the blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from azcp_cluster.core.plan import Shard


@dataclass(frozen=True)
class Block:
    """One ranged GET: ``length`` bytes of file ``file`` at ``offset``."""

    file: int
    offset: int
    length: int


@dataclass
class DownloadStats:
    """What one rank's download did."""

    bytes: int = 0
    requests: int = 0
    retries: int = 0
    retry_causes: Counter[str] = field(default_factory=Counter)
    direct_refused: str = ""  # a path whose filesystem refused O_DIRECT, if any
    worker_bytes: list[int] = field(default_factory=list)  # by download worker process (workers.py)


def blocks_for(shards: Sequence[Shard], block_size: int) -> list[Block]:
    """Cut shards into ranged-GET blocks of at most ``block_size`` bytes."""
    blocks = []
    for shard in shards:
        offset, end = shard.offset, shard.offset + shard.length
        while offset < end:
            length = min(block_size, end - offset)
            blocks.append(Block(shard.file, offset, length))
            offset += length
    return blocks


class Fetcher(Protocol):
    """What fetches a rank's blocks: :class:`~azcp_cluster.download.downloader.Downloader` (in
    the rank), or over worker processes
    (:class:`~azcp_cluster.download.workers.WorkerDownloader`, :class:`~azcp_cluster.download.workers.AutoDownloader`).

    The callbacks may be set after construction and before :meth:`run`, and are called on the
    thread that runs it; ``stats`` is live, also after a failure.
    """

    peer_failed: Callable[[], bool]
    on_bytes: Callable[[int], None]
    on_landed: Callable[[Block], None]

    @property
    def stats(self) -> DownloadStats:
        """What was fetched so far."""

    def run(self, blocks: Sequence[Block]) -> DownloadStats:
        """Fetch every block; raise DownloadError (or PeerFailed) on failure."""
