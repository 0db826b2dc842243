"""The README's demo command runs end to end (a smaller dataset, the same code path)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import clean_env


def test_demo_stages_to_four_nodes_and_checks_the_copies() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "azcp_cluster.devtools.demo", "--size", "6MiB"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[diff] 0 to transfer (0 peer, 0 azure), 27 skipped" in proc.stdout  # the rerun moved nothing
    assert "all 4 node directories hold identical copies" in proc.stdout
