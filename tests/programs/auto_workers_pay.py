"""Run the CLI where auto download workers always find that they pay.

The judge (``topology.handover_workers``) answers 2 whatever it measured, any share may have
workers, the rank may use 8 CPUs, and the probe is cut to 1 MiB and 0.2 s, so a small copy hands its rest to two worker
processes mid-download: the
handover itself (the rank's requests drain, the blocks no request took go to the workers) is
what the test exercises, on a machine where workers would not pay.
"""

from __future__ import annotations

import sys

from azcp_cluster.cli import main
from azcp_cluster.core import topology
from azcp_cluster.download import cpus, workers

cpus.allowed = lambda: list(range(8))  # before the stages import it: room for workers on 2 cores
workers.PROBE_BYTES = 1 << 20
workers.PROBE_SECONDS = 0.2
topology.AUTO_MIN_SHARE = 0  # a share of a few MiB may have workers
topology.handover_workers = lambda *args, **kwargs: 2

if __name__ == "__main__":
    sys.exit(main())
