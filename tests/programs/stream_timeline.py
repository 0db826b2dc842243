"""Run the CLI with a timeline of this rank's fan-out posts and download landings.

    mpiexec -n N python tests/programs/stream_timeline.py LOGDIR ARGS...

Writes LOGDIR/rank-R.log: one JSON line per event, ``{"what": "post"|"landed", "t": wall
seconds}``: each MPI transfer this rank posts, each ranged GET whose bytes are all written.
With AZCP_TEST_PAIR_DEST set, ``{rank}`` in DEST becomes the rank rounded down to even:
ranks 0 and 1 share one DEST (one node), 2 and 3 another.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from azcp_cluster.run.mpi import launcher_rank

RANK = launcher_rank()
LOGDIR = sys.argv.pop(1)
os.makedirs(LOGDIR, exist_ok=True)
LOG = open(os.path.join(LOGDIR, f"rank-{RANK}.log"), "a", encoding="utf-8")  # noqa: SIM115
LOCK = threading.Lock()
if os.environ.get("AZCP_TEST_PAIR_DEST"):
    sys.argv = [arg.replace("{rank}", str(RANK - RANK % 2)) for arg in sys.argv]


def note(what: str) -> None:
    with LOCK:
        LOG.write(json.dumps({"what": what, "t": time.time()}) + "\n")
        LOG.flush()


from azcp_cluster.cli import main  # noqa: E402
from azcp_cluster.download import downloader as download  # noqa: E402
from azcp_cluster.fanout import driver  # noqa: E402

post = driver.FanOutDriver._post
get_once = download.Downloader._get_once


def posting(self: Any, *args: Any) -> Any:
    note("post")
    return post(self, *args)


async def getting(self: Any, *args: Any) -> Any:
    await get_once(self, *args)
    note("landed")


driver.FanOutDriver._post = posting  # type: ignore[method-assign]
download.Downloader._get_once = getting  # type: ignore[method-assign]
sys.exit(main())
