"""Real hosts: three network namespaces with their own hostnames, two ranks each, MPI over TCP.

Each "host" is a network namespace of a box (azcp_cluster/devtools/box.py, unshaped links), and
its ranks run inside ``unshare --uts`` with the namespace's name as hostname, started by the
MPI launcher (MPICH's hydra or Open MPI's PRRTE) through an ssh stand-in. DEST holds ``{host}``
(the hosts share this machine's filesystem, as nodes share nothing but a path name), so each
host has its own copy and two candidate writers. An audit hook records every file each rank
opens below DEST: exactly one rank per host may appear. Needs root (CI has it); everything
created is removed, also when the test fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import box
from azcp_cluster.devtools.box import Box
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import MPI_TIMEOUT, REPO, clean_env, mpi_flavour, mpiexec_path, tree_of

HOSTS = 3
PER_HOST = 2

pytestmark = pytest.mark.skipif(box.unavailable() is not None, reason=box.unavailable() or "")


def test_each_hosts_copy_is_written_by_its_own_ranks_only(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    files = {"model.bin": pseudo_random(5 * MiB + 123, "m"), "sub/config.json": b'{"a": 1}', "sub/empty": b""}
    for rel, data in files.items():
        (source / rel).write_bytes(data)
    logs = tmp_path / "logs"
    logs.mkdir()
    with Box(HOSTS) as bx:
        dest = Path(bx.dest_template).parent
        flavour = mpi_flavour()
        env = clean_env({**bx.env(flavour), "AZCP_AUDIT_WATCH": str(dest), "AZCP_AUDIT_LOG": str(logs)})
        argv = [sys.executable, str(REPO / "tests" / "programs" / "audit_opens.py"),
                str(source), bx.dest_template, "--bcast-chunk", "1MiB", "--no-progress"]  # fmt: skip
        cmd = bx.mpiexec(mpiexec_path(), flavour, argv, per_host=PER_HOST)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=MPI_TIMEOUT, cwd=REPO)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"[cluster] {HOSTS * PER_HOST} ranks on {HOSTS} hosts, {HOSTS} copies" in proc.stdout, proc.stdout
        copies = sorted(p.name for p in dest.iterdir())
        hosts = [h.name for h in bx.hosts]  # in rank order: ranks 0..PER_HOST-1 on the first
        assert copies == sorted(hosts)
        for copy in copies:
            assert tree_of(dest / copy) == files, copy
    # Who wrote where: each host's directory was opened by exactly one rank, its leader.
    writers: dict[str, set[int]] = {}
    for rank in range(HOSTS * PER_HOST):
        log = logs / f"rank-{rank}.log"
        for line in log.read_text().splitlines() if log.exists() else []:
            host_dir = Path(line.split(" ", 1)[1]).relative_to(dest).parts[0]
            writers.setdefault(host_dir, set()).add(rank)
    assert sorted(writers) == copies
    # Each host's copy written only by that host's ranks (each lane what its rail brings: every
    # rank of a host, with several per host), never by another host's.
    assert all(ranks <= set(range(hosts.index(d) * PER_HOST, (hosts.index(d) + 1) * PER_HOST))
               for d, ranks in writers.items()), f"a rank wrote into another host's copy: {writers}"  # fmt: skip
