"""The CLI with ``--fanout auto``'s probe taken whatever the bytes to fan out (not only from 256 MiB on).

    mpiexec -n 3 python tests/programs/probe_always.py SOURCE DEST ...

So that a test of a few MiB shows the probe of a real MPI in a real run, its figures in the report.
"""

from __future__ import annotations

import sys

from azcp_cluster import cli
from azcp_cluster.core import chain

chain.PROBE_MIN_PAYLOAD = 1

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
