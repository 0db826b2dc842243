"""Run the CLI with an unexpected failure on rank 0 outside the fan-out's state machine.

    mpiexec -n N python tests/programs/bug_in_fanout.py ARGS...

AZCP_TEST_BUG: ``retired`` (the driver's bookkeeping of a completed transfer raises OSError,
as a progress bar on a vanished terminal might), ``thread`` (the leader's download thread
cannot be started, as under a process limit), ``readahead`` (nor the fan-out's read-ahead
thread), ``downloader`` (the leader's downloader cannot be made) or ``unannounced`` (rank 0's
fan-out fails before it reads anything and tells no one: the other ranks hear of it only
from what it posts, as when a signal's notice is slower than the broadcast). Every rank
must end with one line and exit 1, not hang in a collective that rank 0 left.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from azcp_cluster.fanout import driver, streaming
from azcp_cluster.run.mpi import launcher_rank
from azcp_cluster.stages import transfer

RANK = str(launcher_rank())
MODE = os.environ.get("AZCP_TEST_BUG", "retired")
if RANK == "0" and MODE == "retired":
    retired = driver.FanOutDriver._retired
    calls = [0]

    def failing(self: Any, run: Any, transfer: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(5, "Input/output error (simulated)")
        retired(self, run, transfer)

    driver.FanOutDriver._retired = failing  # type: ignore[method-assign]
elif RANK == "0" and MODE == "thread":

    def no_thread(self: Any) -> None:
        raise RuntimeError("can't start new thread (simulated)")

    streaming.DownloadThread.start = no_thread  # type: ignore[method-assign]

elif RANK == "0" and MODE == "readahead":
    start = threading.Thread.start

    def refusing(self: threading.Thread) -> None:
        if self.name == "azcp-readahead":
            raise RuntimeError("can't start new thread (simulated)")
        start(self)

    threading.Thread.start = refusing  # type: ignore[method-assign]
elif RANK == "0" and MODE == "downloader":

    def no_downloader(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot make the downloader (simulated)")

    transfer.downloader = no_downloader

if MODE == "unannounced":
    import dataclasses

    from azcp_cluster.core.errors import BroadcastError

    run = driver.FanOutDriver.run

    def unannounced(self: Any, schedule: Any, hooks: Any = None, **kwargs: Any) -> Any:
        # At the run, in place of the stage's own announce and peer_failed.
        if RANK == "0":
            self.stop_requested = lambda: BroadcastError("the fan-out stopped (simulated)", rank=0)
            hooks = dataclasses.replace(hooks, announce=lambda: None)
        else:
            hooks = dataclasses.replace(hooks, peer_failed=lambda: False)  # never told out of band
        return run(self, schedule, hooks, **kwargs)

    driver.FanOutDriver.run = unannounced  # type: ignore[method-assign]

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
