"""Run the CLI with an unexpected failure on rank 0 outside the fan-out's state machine.

    mpiexec -n N python tests/programs/bug_in_fanout.py ARGS...

AZCP_TEST_BUG: ``retired`` (the driver's bookkeeping of a completed transfer raises OSError,
as a progress bar on a vanished terminal might) or ``thread`` (the leader's download thread
cannot be started, as under a process limit). Every rank must end with one line and exit 1,
not hang in a collective that rank 0 left.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from azcp_cluster import broadcast, streaming

RANK = next((os.environ[k] for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK") if k in os.environ), "0")
MODE = os.environ.get("AZCP_TEST_BUG", "retired")
if RANK == "0" and MODE == "retired":
    retired = broadcast.Broadcaster._retired
    calls = [0]

    def failing(self: Any, transfer: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(5, "Input/output error (simulated)")
        retired(self, transfer)

    broadcast.Broadcaster._retired = failing  # type: ignore[method-assign]
elif RANK == "0" and MODE == "thread":

    def no_thread(self: Any) -> None:
        raise RuntimeError("can't start new thread (simulated)")

    streaming.DownloadThread.start = no_thread  # type: ignore[method-assign]

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
