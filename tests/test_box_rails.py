"""A cluster in a box with two rails (azcp_cluster/devtools/box.py, ``rails=2``): each host has two
fabric NICs, ``ib0`` and ``ib1``, on two bridges with their own subnets, each shaped.

A raw pair of chains (benchmarks/raw_fanout.py ``--chains 2``), local rank i of each host
bound to ``ib<i>`` by the box's wrapper (a site's way), moves its bytes on both rails: each
rail's counters (the hosts' NICs on it) carry about half. And the tool with ``--rails auto``
binds its ranks itself (nothing in the box's environment binds them) and copies byte for byte.
Needs root (CI has it); small (2 hosts x 2 ranks, a few MiB).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import box
from azcp_cluster.devtools.box import Box, Link
from azcp_cluster.devtools.datasets import checkpoint
from tests.conftest import MPI_TIMEOUT, REPO, clean_env, mpi_flavour, mpiexec_path, tree_of

HOSTS = 2
RAILS = 2
FABRIC = Link(mbit=400)
SIZE = 16 * MiB

pytestmark = [pytest.mark.slow, pytest.mark.skipif(box.unavailable() is not None, reason=box.unavailable() or "")]


def test_a_chain_per_rail_moves_bytes_on_both_rails(tmp_path: Path) -> None:
    flavour = mpi_flavour()
    out = tmp_path / "raw.json"
    with Box(HOSTS, fabric=FABRIC, rails=RAILS) as bx:
        tag = bx.tag
        argv = [bx.rail_wrapper, sys.executable, str(REPO / "benchmarks" / "raw_fanout.py"), "--pattern", "chain",
                "--chains", str(RAILS), "--bytes", str(SIZE), "--piece", str(1 * MiB), "--json", str(out)]  # fmt: skip
        before = bx.rail_bytes()
        proc = subprocess.run(bx.mpiexec(mpiexec_path(), flavour, argv, per_host=RAILS), env=clean_env(bx.env(flavour)),
                              capture_output=True, text=True, timeout=MPI_TIMEOUT, cwd=REPO)  # fmt: skip
        moved = [a - b for a, b in zip(bx.rail_bytes(), before, strict=True)]
        assert proc.returncode == 0, proc.stdout + proc.stderr
        figures = json.loads(out.read_text())
        assert figures["intact"] and figures["chains"] == RAILS and figures["ranks"] == HOSTS * RAILS
        print(f"{flavour}: rails carried {moved} bytes for {SIZE} in {figures['seconds']:.2f} s")
        # Each chain carries its half once, host 0 to host 1, on its own rail (and a little MPI besides).
        for carried in moved:
            assert SIZE // RAILS <= carried <= SIZE // RAILS * 1.1 + 1 * MiB, moved
        assert bx.processes() == []
    assert box.leftovers(tag) == []


def test_the_tool_binds_its_ranks_to_the_rails_itself(tmp_path: Path) -> None:
    flavour = mpi_flavour()
    files = checkpoint(4 * MiB, small=40)
    source = tmp_path / "src"
    for name, data in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    with Box(HOSTS, fabric=FABRIC, rails=RAILS) as bx:
        env = bx.env(flavour)
        assert "FI_TCP_IFACE" not in env and "OMPI_MCA_btl_tcp_if_include" not in env  # nothing binds but the tool
        argv = [sys.executable, "-m", "azcp_cluster", str(source), bx.dest_template, "--no-progress", "--rails", "auto"]
        before = bx.rail_bytes()
        proc = subprocess.run(bx.mpiexec(mpiexec_path(), flavour, argv, per_host=RAILS), env=clean_env(env),
                              capture_output=True, text=True, timeout=MPI_TIMEOUT, cwd=REPO)  # fmt: skip
        moved = [a - b for a, b in zip(bx.rail_bytes(), before, strict=True)]
        assert proc.returncode == 0, proc.stdout + proc.stderr
        size = sum(len(d) for d in files.values())
        print(f"{flavour}: the tool's rails carried {moved} bytes for {size}")
        # The second host's copy came over both rails, each lane's chain carrying what that lane
        # read (the one large file cut into shards small enough for both: scheduling.shard_size_for).
        assert sum(moved) >= size and min(moved) >= 0.3 * size, moved
        for host in bx.hosts:
            assert tree_of(bx.dest_of(host)) == files, host.name


def test_ranks_per_host_are_a_multiple_of_the_rails() -> None:
    bx = Box(2, rails=2)
    with pytest.raises(ValueError, match="multiple of the rails"):
        bx.mpiexec("mpiexec", "mpich", ["true"], per_host=3)
    with pytest.raises(ValueError, match="rails must be"):
        Box(2, rails=0)
