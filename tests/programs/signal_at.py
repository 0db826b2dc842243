"""Run the CLI, sending this rank a signal when it reaches a chosen function.

``AZCP_SIGNAL_AT=module:Class.method`` (or ``module:function``), ``AZCP_SIGNAL_WHEN=before|after``
(the call), ``AZCP_SIGNAL=TERM|INT``, ``AZCP_SIGNAL_RANK`` (default 0): the process sends itself the
signal once, at that point, as a launcher or Slurm could at any instant.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from typing import Any

from azcp_cluster.cli import command
from azcp_cluster.run.mpi import launcher_rank

module_name, _, path = os.environ["AZCP_SIGNAL_AT"].partition(":")
owner: Any = importlib.import_module(module_name)
*parents, name = path.split(".")
for part in parents:
    owner = getattr(owner, part)
original = getattr(owner, name)
signum = getattr(signal, "SIG" + os.environ.get("AZCP_SIGNAL", "TERM"))
after = os.environ.get("AZCP_SIGNAL_WHEN", "before") == "after"
sent = False


@functools.wraps(original)
def hooked(*args: Any, **kwargs: Any) -> Any:
    global sent
    if not after and not sent:
        sent = True
        os.kill(os.getpid(), signum)
    result = original(*args, **kwargs)
    if after and not sent:
        sent = True
        os.kill(os.getpid(), signum)
    return result


if launcher_rank() == int(os.environ.get("AZCP_SIGNAL_RANK", "0")):
    setattr(owner, name, hooked)

if __name__ == "__main__":
    sys.exit(command())
