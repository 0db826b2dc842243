"""Run the CLI as if each rank ran on a machine of its own (this machine can be only one).

The boot id that tells machines apart (localfs.machine_id) is read from
``$AZCP_BOOT_IDS/<rank>``, a file the test writes per rank (the rank from MPICH's PMI_RANK
or Open MPI's OMPI_COMM_WORLD_RANK).
"""

from __future__ import annotations

import os
import sys

from azcp_cluster.dest import localfs

_rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
localfs.BOOT_ID = os.path.join(os.environ["AZCP_BOOT_IDS"], _rank)

from azcp_cluster.cli import main  # noqa: E402

sys.exit(main())
