"""Run the CLI with an unexpected exception (a bug, not an AzcpError) in one rank's download.

    mpiexec -n N python tests/programs/bug_in_download.py ARGS...

Rank AZCP_TEST_BUG_RANK (default 0) raises RuntimeError on its second ranged GET. The job must
end on every rank with exit 1 and one line, not hang (the rank's download runs on a thread
of its own while it streams).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from azcp_cluster.download import downloader as download
from azcp_cluster.run.mpi import launcher_rank

if int(os.environ.get("AZCP_TEST_BUG_RANK", "0")) == launcher_rank():
    get_once = download.Downloader._get_once
    calls = [0]

    async def buggy(self: Any, *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("simulated bug in the download")
        return await get_once(self, *args)

    download.Downloader._get_once = buggy  # type: ignore[method-assign]

from azcp_cluster.cli import main

sys.exit(main())
