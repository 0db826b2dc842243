"""Run the CLI with the reader of a local SOURCE slowed down, as on a slow shared filesystem.

Each read the broadcast makes sleeps AZCP_SLOW_READ seconds first, so a run can be stopped
while it reads. AZCP_FSTYPE (a statfs magic number, e.g. 0x65735546 for FUSE) makes the
listing take SOURCE for a filesystem of that type: no FUSE or FAT mount can be made here.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from azcp_cluster.dest import localsource
from azcp_cluster.fanout import readahead

_DELAY = float(os.environ.get("AZCP_SLOW_READ", "0"))
_read_at = readahead.DirectReader.read_at


def slow_read_at(self: Any, buf: Any, length: int, offset: int) -> int:
    time.sleep(_DELAY)
    return _read_at(self, buf, length, offset)


readahead.DirectReader.read_at = slow_read_at  # type: ignore[method-assign]
if "AZCP_FSTYPE" in os.environ:
    _magic = int(os.environ["AZCP_FSTYPE"], 0)
    localsource.filesystem_type = lambda path: _magic

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
