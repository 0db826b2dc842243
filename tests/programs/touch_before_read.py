"""Run the CLI; world rank AZCP_TOUCH_RANK moves the modification time of SOURCE file
AZCP_TOUCH_FILE on by a second just before it first reads it: that rank sees the file changed
since it was listed, and the run sends it again in a second round (tests/test_rail_chains.py).

With AZCP_SLOW_JOURNAL_RANK, that rank's block journal starts each turn 0.6 s late (a slow
fdatasync of its previous turn, as a busy disk gives): what it wrote of the file is still
unrecorded when the second round begins. Rank from hydra's PMI_RANK or Open MPI's
OMPI_COMM_WORLD_RANK.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from azcp_cluster.dest import journal
from azcp_cluster.fanout import readahead

_read_extent = readahead.ReadAhead._read_extent
_touched: list[str] = []


def _rank() -> int:
    return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))


def touch_then_read(self: Any, extent: Any, buffer: Any) -> Any:
    path = self.source_of(extent.file)
    wanted = os.environ["AZCP_TOUCH_FILE"]
    if _rank() == int(os.environ["AZCP_TOUCH_RANK"]) and not _touched and path and path.endswith(wanted):
        _touched.append(path)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    return _read_extent(self, extent, buffer)


readahead.ReadAhead._read_extent = touch_then_read  # type: ignore[method-assign]

if _rank() == int(os.environ.get("AZCP_SLOW_JOURNAL_RANK", "-1")):
    _flush = journal.Journal.flush

    def slow_flush(self: Any) -> None:
        time.sleep(0.6)
        _flush(self)

    journal.Journal.flush = slow_flush  # type: ignore[method-assign]

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
