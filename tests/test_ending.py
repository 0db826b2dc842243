"""Ending the job from one rank (``run/ending.py``): the abort, then this process's own exit.

``MPI_Abort`` may never return (MPICH over libfabric's tcp with a stopped rank in the
communicator), and mpi4py keeps the interpreter's lock through it: the deadline must end the
process with the documented code anyway. In process, the order of what ``end_job`` does; in a
subprocess, each way an abort can fail to end it. The cluster box's runs (a rank stopped, a
host cut off, under MPICH and Open MPI) are in tests/test_cluster_box.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from azcp_cluster.run import ending
from tests.conftest import REPO

PROGRAM = Path(__file__).parent / "programs" / "abort_hangs.py"
GRACE = 0.5  # seconds: the tests' deadline (the run's is ending.ABORT_GRACE)
LINE = "azcp-cluster: error [peer]: rank 3: sent nothing for 5 s"


def test_the_line_then_the_deadline_then_the_abort_then_the_exit(capsys: pytest.CaptureFixture[str]) -> None:
    done: list[object] = []

    def abort(code: int) -> None:
        assert capsys.readouterr().err == LINE + "\n"  # said, and flushed, before the abort
        done.append(("abort", code))

    with pytest.raises(SystemExit) as leaving:
        ending.end_job(
            abort, 10, LINE, grace=2.5, arm=lambda s, c: done.append(("arm", s, c)), leave=lambda c: done.append(c)
        )
    assert done == [("arm", 2.5, 10), ("abort", 10), 10]
    assert leaving.value.code == 10
    assert capsys.readouterr().err == ""  # once


def test_an_abort_that_raises_still_ends_with_the_code() -> None:
    left: list[int] = []

    def abort(code: int) -> None:
        raise RuntimeError("MPI_Abort failed")

    with pytest.raises(SystemExit):
        ending.end_job(abort, 143, "", arm=lambda s, c: None, leave=left.append)
    assert left == [143]


def test_the_run_gives_the_abort_a_few_seconds() -> None:
    assert 1.0 <= ending.ABORT_GRACE <= 5.0


@pytest.mark.parametrize("how", ["gil", "nogil", "spin", "raise", "nogil-no-timer"])
def test_a_hung_abort_ends_the_process_with_the_code_after_the_grace(how: str) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(PROGRAM), how, str(GRACE)], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    took = time.monotonic() - started
    assert proc.returncode == 10, (proc.returncode, proc.stderr)
    assert proc.stderr == LINE + "\n" and proc.stdout == "", proc.stderr
    if how == "raise":
        assert took < GRACE + 5, took  # at once (the interpreter's start aside)
    else:
        assert GRACE <= took < GRACE + 5, took  # the deadline's, not the test's timeout (30 s)
