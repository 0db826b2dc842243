"""End a "job" through ``ending.end_job`` with an abort that never ends the process (``argv``: how, grace).

How the abort fails: ``gil`` blocks in C holding the interpreter's lock (as mpi4py's
``Comm.Abort`` does inside a hung ``MPI_Abort``), ``nogil`` blocks with the lock free, ``spin``
loops in Python, ``raise`` raises; ``nogil-no-timer`` blocks with the lock free where the C
library has no timer to arm (the thread fallback). The abort runs on a second thread, as the
pulse's watcher's does, while the main thread sleeps. Prints nothing but the one line; exit
code 10 expected, ``grace`` seconds after the start.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

from azcp_cluster.run import ending


def abort(how: str) -> None:
    if how == "gil":
        ctypes.PyDLL(None).sleep(60)  # a PyDLL call keeps the interpreter's lock
    elif how.startswith("nogil"):
        time.sleep(60)
    elif how == "spin":
        while True:
            pass
    elif how == "raise":
        raise RuntimeError("MPI_Abort failed")


if __name__ == "__main__":
    how, grace = sys.argv[1], float(sys.argv[2])
    if how == "nogil-no-timer":
        ending.exit_timer = lambda seconds, code: False  # type: ignore[assignment]
    line = "azcp-cluster: error [peer]: rank 3: sent nothing for 5 s"
    threading.Thread(target=ending.end_job, args=(lambda code: abort(how), 10, line), kwargs={"grace": grace}).start()
    time.sleep(60)
    sys.exit(0)  # never reached: the deadline ends the process first
