"""The driver's pipeline order, on a real MPI rank (``tests/programs/driver_progress.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import MPI_TIMEOUT, REPO, clean_env, mpiexec_path

PROGRAM = REPO / "tests" / "programs" / "driver_progress.py"


def test_a_finished_chunk_is_written_while_the_owner_reads_its_next(tmp_path: Path) -> None:
    """The MPI thread passes a finished chunk on while it waits for the next read.

    It used to wait for the read first: the disk took no writes while the owner read,
    which cost the broadcast stage about a fifth of its speed in the benchmark.
    """
    cmd = [mpiexec_path(), "-n", "1", sys.executable, str(PROGRAM), str(tmp_path)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=MPI_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"written_before_next_read": True, "whole": True}
