"""Run the CLI; after the listing, the reader's SOURCE file ``a.bin`` is replaced by a FIFO.

A source file that cannot be read when its turn comes (here: no longer a regular file; as
root, permissions cannot stand in for it) must end the run as a SOURCE error, exit 5, and
the FIFO must not hang the reader.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from azcp_cluster import pipeline

_list = pipeline._Run.list_stage


def list_then_swap(self: Any, auth: Any) -> Any:
    listing = _list(self, auth)
    if self.rank == self.reader:
        path = os.path.join(self.source_root, "a.bin")
        os.unlink(path)
        os.mkfifo(path)
    return listing


pipeline._Run.list_stage = list_then_swap  # type: ignore[method-assign]

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
