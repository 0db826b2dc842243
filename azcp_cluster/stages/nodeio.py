"""A rank's node I/O for one run, with one owner: the download's buffers, the node writers, the block journal.

The allocate stage makes each of them once and hands it to a :class:`NodeIO`, which is the
only thing that closes it. The transfer stage ends a part early when its memory or threads
are no longer needed (the download's buffers before the fan-out, the fan-out's writer at
its end); :meth:`NodeIO.close`, called once by ``RunContext.close`` whatever stage failed,
ends what is left, in the order that keeps the journal exact: the writers first (every
write they finished is then recorded), the journal last.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from azcp_cluster.core.errors import AzcpError

if TYPE_CHECKING:
    from azcp_cluster.dest.journal import Journal
    from azcp_cluster.dest.nodewriter import NodeWriter
    from azcp_cluster.download.writepool import WritePool


class NodeIO:
    """The node I/O of one rank: made by allocate, ended here (each part at most once)."""

    def __init__(self) -> None:
        self.pool: WritePool | None = None  # the download's buffers (a rank that downloads in its own process)
        # The node writers: the download's, and the fan-out's (leaders); one and the same for a
        # streaming leader that downloads in its own process (one set of threads for both).
        self.download_writer: NodeWriter | None = None
        self.fanout_writer: NodeWriter | None = None
        self.journal: Journal | None = None  # a rank that writes into its node's files: its block journal

    def journal_written(self) -> object | None:
        """The journal's record of a write (for a writer or a landing sink), or None without a journal."""
        return self.journal.written if self.journal is not None else None

    def free_buffers(self) -> None:
        """Free the download's buffers (also those kept for the fan-out, which may still hold them):
        their memory is not the fan-out's, nor the worker processes'."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def end_download(self) -> None:
        """The download's end: its writer stopped after its queued writes, its buffers freed."""
        writer, self.download_writer = self.download_writer, None
        if writer is not None and writer is not self.fanout_writer:
            writer.close()
        self.free_buffers()

    def end_fanout(self) -> None:
        """The fan-out's end: its writer stopped after its queued writes (the download's too, if shared)."""
        writer, self.fanout_writer = self.fanout_writer, None
        if writer is not None:
            writer.close()
        if self.download_writer is writer:
            self.download_writer = None

    def end_journal(self) -> None:
        """Record what was written since the journal's last append, and stop it; raise the error
        of a sync it saw fail (the copy's bytes may not be on the disk)."""
        journal, self.journal = self.journal, None
        if journal is not None:
            journal.close()

    def close(self) -> None:
        """End every part still open: the writers after their queued writes, the buffers, then the journal.

        The run has failed already (or ends failing at its sync) when a part is still open
        here: the journal's own sync error does not replace that error.
        """
        self.end_download()
        self.end_fanout()
        with contextlib.suppress(AzcpError):
            self.end_journal()
