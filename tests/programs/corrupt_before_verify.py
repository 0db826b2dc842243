"""Run the CLI, corrupting one copy on disk after the fsync and before ``--verify`` reads it back.

A test-only hook for what a disk, a filesystem or another writer can do to a file between
its arrival and the verification: after ``_Run.sync`` (every temporary file fsynced), the
rank named by AZCP_CORRUPT_RANK flips one byte of the file AZCP_CORRUPT_FILE (a path below
DEST) in its temporary file, then the run goes on.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from azcp_cluster import pipeline
from azcp_cluster.localfs import temp_path

_sync = pipeline._Run.sync


def sync_then_corrupt(self: Any, listing: Any, transfer: list[int]) -> None:
    _sync(self, listing, transfer)
    if self.rank == int(os.environ["AZCP_CORRUPT_RANK"]):
        path = temp_path(self.dest, os.environ["AZCP_CORRUPT_FILE"])
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, 0)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), 0)
            os.fsync(fd)
        finally:
            os.close(fd)


pipeline._Run.sync = sync_then_corrupt  # type: ignore[method-assign]

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
