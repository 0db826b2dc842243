"""Run the CLI; after the listing, the reader's SOURCE file ``a.bin`` is replaced by a FIFO.

A source file that cannot be read when its turn comes (here: no longer a regular file; as
root, permissions cannot stand in for it) must end the run as a SOURCE error, exit 5, and
the FIFO must not hang the reader.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from azcp_cluster.stages import survey

_list = survey.list_source


def list_then_swap(ctx: Any, place: Any) -> Any:
    listed = _list(ctx, place)
    if ctx.rank == place.reader:
        path = os.path.join(ctx.source_root, "a.bin")
        os.unlink(path)
        os.mkfifo(path)
    return listed


survey.list_source = list_then_swap

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
