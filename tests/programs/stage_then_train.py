"""A small mpi4py "training" program that stages its data with the Python API first.

Writes one JSON file per rank (OUT_DIR/rank-N.json): what stage() returned, or the typed error it raised. Then it
keeps using MPI (an allreduce), as a training loop would, to show that the communicator is
still healthy after staging, and after a staging failure too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpi4py import MPI

import azcp_cluster

source, dest, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
explicit_comm = len(sys.argv) > 4 and sys.argv[4] == "--explicit-comm"
comm = MPI.COMM_WORLD
try:
    if explicit_comm:
        report = azcp_cluster.stage(source, dest, comm=comm, quiet=True, bcast_chunk="1MiB", compare="etag")
    else:
        report = azcp_cluster.stage(source, dest, quiet=True, bcast_chunk=1 << 20, verify=True)
    outcome = {"ok": True, "files": report.files, "bytes": report.bytes, "writers": report.writers}
except azcp_cluster.AzcpError as exc:
    outcome = {"ok": False, "type": type(exc).__name__, "code": exc.exit_code, "line": exc.one_line()}
total = comm.allreduce(1)
record = {"rank": comm.Get_rank(), "after": total, **outcome}
(out_dir / f"rank-{comm.Get_rank()}.json").write_text(json.dumps(record))
