"""Run the CLI with an audit hook that records every file this rank opens below a watched path.

Used by the tests to prove that only the reader rank opens a local SOURCE. Python raises the
``open`` audit event for ``open()`` and ``os.open()``, and ``os.scandir`` for directory walks,
which are all the ways the tool reads a file or lists a directory.
Environment: AZCP_AUDIT_WATCH (the path), AZCP_AUDIT_LOG (a directory for one log per rank).
"""

from __future__ import annotations

import os
import sys
from typing import Any

WATCH = os.path.realpath(os.environ["AZCP_AUDIT_WATCH"])
from azcp_cluster.run.mpi import launcher_rank  # noqa: E402

RANK = launcher_rank()
LOG = open(os.path.join(os.environ["AZCP_AUDIT_LOG"], f"rank-{RANK}.log"), "a", encoding="utf-8")  # noqa: SIM115


def hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in ("open", "os.scandir", "os.listdir") or not args or args[0] is None:
        return
    target = args[0]
    if isinstance(target, int):
        return  # a descriptor: its opening was recorded
    path = os.path.realpath(os.fsdecode(target))
    if path == WATCH or path.startswith(WATCH + os.sep):
        LOG.write(f"{event} {path}\n")
        LOG.flush()


sys.addaudithook(hook)

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
