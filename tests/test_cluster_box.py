"""A cluster in a box (azcp_cluster/devtools/box.py): four hosts with shaped links, two ranks each.

Each host is a network namespace with a 100 Mbit/s frontend NIC towards the emulator
("Azure", in a namespace of its own) and a 400 Mbit/s fabric NIC for MPI, and its own DEST
(``{host}``). A copy from the emulator must leave it exactly once (the bytes the emulator sent,
counted on its link, are the dataset's and a little protocol, whatever the number of hosts),
and a local SOURCE is read by one rank; either way every host ends with the same bytes, and
the bytes between hosts go over the fabric (counted on its NICs), not shared memory or the
frontend. Afterwards nothing of the box is left: no process, namespace, link or directory.
Run under MPICH and Open MPI (scripts/test-openmpi). Needs root (CI has it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite, box
from azcp_cluster.devtools.box import Box, Link
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import MPI_TIMEOUT, REPO, clean_env, mpi_flavour, mpiexec_path, tree_of

HOSTS = 4
PER_HOST = 2
FRONT = Link(mbit=100)
FABRIC = Link(mbit=400)

pytestmark = pytest.mark.skipif(box.unavailable() is not None, reason=box.unavailable() or "")

FILES = {
    "weights/model-00001.bin": pseudo_random(9 * MiB + 4321, "a"),
    "weights/model-00002.bin": pseudo_random(5 * MiB, "b"),
    "config.json": b'{"layers": 2}',
    "tokenizer/vocab.txt": pseudo_random(300_000, "c"),
    "empty": b"",
}
SIZE = sum(len(data) for data in FILES.values())


def copy_in_box(bx: Box, source: str, json_path: Path, env: dict[str, str] | None = None) -> dict[str, object]:
    """Run the tool on every host of ``bx`` (PER_HOST ranks each); its JSON report."""
    flavour = mpi_flavour()
    argv = [sys.executable, "-m", "azcp_cluster", source, bx.dest_template, "--json", str(json_path), "--no-progress"]
    cmd = bx.mpiexec(mpiexec_path(), flavour, argv, per_host=PER_HOST)
    proc = subprocess.run(
        cmd, env=clean_env({**bx.env(flavour), **(env or {})}), capture_output=True, text=True,
        timeout=MPI_TIMEOUT, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[cluster] {HOSTS} nodes, {HOSTS * PER_HOST} ranks, {HOSTS} writers" in proc.stdout, proc.stdout
    report: dict[str, object] = json.loads(json_path.read_text())
    return report


def assert_every_host_has_it(bx: Box) -> None:
    for host in bx.hosts:
        assert tree_of(bx.dest_of(host)) == FILES, host.name


def assert_nothing_left(bx: Box, tag: str) -> None:
    assert box.leftovers(tag) == [], "the box left namespaces, links or its directory behind"


def test_copy_from_the_emulator_leaves_it_once(tmp_path: Path) -> None:
    with Box(HOSTS, front=FRONT, fabric=FABRIC) as bx:
        tag = bx.tag
        with bx.emulator() as emu:
            azurite.upload(emu, "data", {f"ckpt/{name}": data for name, data in FILES.items()})
            sent, fabric = bx.emulator_sent(), bx.fabric_bytes()
            report = copy_in_box(bx, emu.url("data", "ckpt"), tmp_path / "report.json", emu.key_env())
            egress = bx.emulator_sent() - sent
            between_hosts = bx.fabric_bytes() - fabric
        assert report["downloaded_bytes"] == SIZE
        # The dataset left "Azure" once: its bytes, plus HTTP headers, the listing and TCP/IP.
        assert SIZE <= egress <= 1.06 * SIZE + 1 * MiB, (egress, SIZE)
        # Each host lacks what its own ranks did not download: (N - 1) x S in all, over the fabric.
        assert between_hosts >= (HOSTS - 1) * SIZE, (between_hosts, SIZE)
        assert_every_host_has_it(bx)
        assert bx.processes() == [], "a rank, an MPI daemon or the emulator still runs in the box"
    assert_nothing_left(bx, tag)


def test_copy_from_a_local_source_goes_over_the_fabric(tmp_path: Path) -> None:
    source = tmp_path / "src"
    for name, data in FILES.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    with Box(HOSTS, front=FRONT, fabric=FABRIC) as bx:
        tag = bx.tag
        fabric, front = bx.fabric_bytes(), bx.front_bytes()
        report = copy_in_box(bx, str(source), tmp_path / "report.json")
        between_hosts, frontend = bx.fabric_bytes() - fabric, bx.front_bytes() - front
        assert report["source_bytes_by_rank"] == [SIZE] + [0] * (HOSTS * PER_HOST - 1)
        # One reader (rank 0, on the first host): every other host received the whole of it
        # over its fabric NIC, and nothing went over the frontend but stray packets.
        assert between_hosts >= (HOSTS - 1) * SIZE, (between_hosts, SIZE)
        assert frontend < 1 * MiB, frontend
        assert_every_host_has_it(bx)
        assert bx.processes() == []
    assert_nothing_left(bx, tag)


CRASH = """
import os, signal, sys
from azcp_cluster.devtools.box import Box, Link
bx = Box(2, front=Link(100), fabric=Link(400), tmpfs_dest=True)
bx.start()
with bx.emulator():
    print(bx.tag, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_box_whose_owner_died_is_swept() -> None:
    # A benchmark killed with its box up (and an emulator running in it, and a tmpfs mounted):
    # the next box to start removes all of it.
    proc = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    tag = proc.stdout.split()[0]
    left = box.leftovers(tag)
    assert f"{tag}h1" in left and f"{tag}fab" in left, left
    emulator = [int(p) for p in subprocess.run(["ip", "netns", "pids", f"{tag}az"], capture_output=True,
                                               text=True, check=True).stdout.split()]  # fmt: skip
    assert emulator, "the dead box's emulator should still run before the sweep"
    assert tag in box.sweep()
    assert box.leftovers(tag) == []
    for pid in emulator:
        assert not running(pid), "the sweep left the dead box's emulator running"


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a parent that was not ours to reap it does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_live_box_is_not_swept() -> None:
    with Box(1) as bx:
        assert bx.tag not in box.sweep()
        assert f"{bx.tag}h0" in box.leftovers(bx.tag)
    assert box.leftovers(bx.tag) == []


@pytest.mark.parametrize(("link", "expected"), [(Link(None), None), (Link(400), 50e6), (Link(25_000), 3.125e9)])
def test_link_rates(link: Link, expected: float | None) -> None:
    assert link.bytes_per_s == expected
