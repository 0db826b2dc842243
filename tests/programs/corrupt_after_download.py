"""Run the CLI, flipping one byte of a downloaded temporary file between the download stage and
the fan-out (``--no-overlap``), and optionally stopping the run with SIGTERM after the sync.

Review of issue 38 (tests/test_review_i38.py). What a disk, a filesystem or another writer can do to
a block between its landing (its CRC-32 taken as it arrived) and the read-ahead that sends it to
the other nodes. Every rank flips the byte at AZCP_CORRUPT_OFFSET of AZCP_CORRUPT_FILE in its own
temporary file once the download stage has ended on every rank (its last agreement): on the node
that downloaded that block the flipped byte is what the fan-out reads and sends; on the others the
byte lies in a range the fan-out overwrites. With AZCP_STOP_AFTER_SYNC=1 every rank ends at once
(os._exit) once the sync stage is done (the journal closed, every range recorded): a run stopped
before --verify and the rename, as a preemption would.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from azcp_cluster.dest.localfs import temp_path
from azcp_cluster.stages import finish, transfer

_download = transfer.download
_sync = finish.sync


def download_then_corrupt(ctx: Any, place: Any, *rest: Any) -> None:
    _download(ctx, place, *rest)
    if place.leader:
        path = temp_path(ctx.dest, os.environ["AZCP_CORRUPT_FILE"])
        at = int(os.environ.get("AZCP_CORRUPT_OFFSET", "0"))
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
            os.fsync(fd)
        finally:
            os.close(fd)


def sync_then_stop(ctx: Any, place: Any, moved: Any) -> None:
    _sync(ctx, place, moved)
    if os.environ.get("AZCP_STOP_AFTER_SYNC") == "1":
        os._exit(99)  # the journal was closed by the sync stage: every range is recorded


transfer.download = download_then_corrupt
finish.sync = sync_then_stop

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
