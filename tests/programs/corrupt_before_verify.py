"""Run the CLI, corrupting one copy on disk after the fsync and before ``--verify`` reads it back.

A test-only hook for what a disk, a filesystem or another writer can do to a file between
its arrival and the verification: after ``stages.finish.sync`` (every temporary file fsynced), the
rank named by AZCP_CORRUPT_RANK flips one byte of the file AZCP_CORRUPT_FILE (a path below
DEST) in its temporary file, then the run goes on.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from azcp_cluster.dest.localfs import temp_path
from azcp_cluster.stages import finish

_sync = finish.sync


def sync_then_corrupt(ctx: Any, place: Any, moved: Any) -> None:
    _sync(ctx, place, moved)
    if ctx.rank == int(os.environ["AZCP_CORRUPT_RANK"]):
        path = temp_path(ctx.dest, os.environ["AZCP_CORRUPT_FILE"])
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, 0)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), 0)
            os.fsync(fd)
        finally:
            os.close(fd)


finish.sync = sync_then_corrupt

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
