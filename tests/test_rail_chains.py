"""Several ranks per node: one fan-out chain per rail, lane i of every node in chain i (issue 40).

The lanes and the rail count are pure (core/topology.py), the plan's cut by rail too
(stages/scheduling.rail_plans); the runs are real: two nodes of two ranks each on this host,
as ``mpiexec``'s two program blocks with their own DEST (MPMD), from a local SOURCE and from
the emulator, streamed and not, with --verify, and with a rank of lane 1 killed mid-copy.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from azcp_cluster.core.plan import plan_transfers
from azcp_cluster.core.schedule import payload
from azcp_cluster.core.topology import Topology, lanes_of, rail_count
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.stages.scheduling import rail_plans
from azcp_cluster.stages.setup import Placement
from tests.conftest import clean_env, mpiexec_path

MiB = 1 << 20


def _topo(groups: list[list[int]], leaders: list[int] | None = None, downloaders: list[int] | None = None) -> Topology:
    size = sum(len(g) for g in groups)
    group_of = [0] * size
    for index, members in enumerate(groups):
        for rank in members:
            group_of[rank] = index
    return Topology(
        tuple(group_of),
        tuple(leaders if leaders is not None else [min(g) for g in groups]),
        tuple(downloaders if downloaders is not None else range(size)),
        len(groups),
    )


# -- lanes and rails (pure) ----------------------------------------------------------------------


@pytest.mark.parametrize(("nodes", "per"), list(itertools.product([1, 2, 3, 8], [1, 2, 4])))
def test_every_node_of_equal_size_gets_one_rail_per_rank(nodes: int, per: int) -> None:
    groups = [[n * per + i for i in range(per)] for n in range(nodes)]
    topo = _topo(groups)
    lanes = lanes_of(topo)
    assert [lanes[r] for g in groups for r in g] == list(range(per)) * nodes  # the leader 0, the others by rank
    assert rail_count(topo, topo.downloaders) == (per if nodes >= 2 and per >= 2 else 1)


def test_the_leader_is_lane_0_wherever_it_is_among_its_node() -> None:
    topo = _topo([[0, 1, 2], [3, 4, 5]], leaders=[2, 3])  # a reader leads its node
    assert lanes_of(topo) == (1, 2, 0, 0, 1, 2)


def test_unequal_nodes_or_a_node_that_downloads_in_part_run_one_chain() -> None:
    assert rail_count(_topo([[0, 1], [2, 3, 4]]), range(5)) == 1  # unequal
    assert rail_count(_topo([[0, 1], [2, 3]]), [0, 2, 3]) == 1  # rank 1 of node 0 does not download
    assert rail_count(_topo([[0, 1], [2, 3]]), [2, 3]) == 2  # node 0 only receives: its lanes still do
    assert rail_count(_topo([[0, 1], [2, 3]]), []) == 1  # nothing comes in


def test_the_plan_cut_by_rail_puts_each_shard_on_its_owners_lane_once() -> None:
    """Every shard on exactly one rail, the one of the lane that owns it; the rails' transfers
    together carry the bytes the one-rail schedule carries."""
    from azcp_cluster.core.packing import transfer_schedule

    topo = _topo([[0, 1], [2, 3], [4, 5]])
    place = Placement(topo, 0, True, 0, (), None, rails=2, lane=0, owners=tuple(range(6)))
    sizes = [7 * MiB + 5, 3 * MiB, 1, 12 * MiB + 999, 0, 64 * 1024]
    plan = plan_transfers(sizes, [[] for _ in sizes], 6, 2 * MiB, owners=list(range(6)), copies=3)
    parts = rail_plans(plan, place)
    lanes = np.asarray(lanes_of(topo))
    assert sum(p.shard_count for p in parts) == plan.shard_count
    for lane, part in enumerate(parts):
        assert (lanes[part.columns.owner] == lane).all()
    one = transfer_schedule(plan, MiB, 3, root_of=topo.group_of)
    both = [transfer_schedule(p, MiB, 3, root_of=topo.group_of) for p in parts]
    assert sum(payload(t) for t in both) == payload(one) == sum(sizes)  # each byte in one transfer, on one rail
    assert all(payload(t) > 0 for t in both)  # both rails carry bytes


# -- two nodes of two ranks on this host ---------------------------------------------------------


def _mpmd(args_a: list[str], args_b: list[str], per: int = 2) -> list[str]:
    """``mpiexec`` with two program blocks: node A's ranks then node B's, each block its own DEST."""
    run = [sys.executable, "-m", "azcp_cluster"]
    return [mpiexec_path(), "-n", str(per), *run, *args_a, ":", "-n", str(per), *run, *args_b]


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".azcp")
    }


def _source(tmp_path: Path, large: int, size: int, small: int, seed: str) -> tuple[Path, dict[str, bytes]]:
    """A local SOURCE under ``tmp_path``: ``large`` files of about ``size`` bytes, ``small`` small ones in sub/."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {f"f{i}.bin": pseudo_random(size + 4097 * i, f"{seed}{i}") for i in range(large)}
    files.update({f"sub/s{i}.txt": pseudo_random(300 + i, f"{seed}s{i}") for i in range(small)})
    for name, data in files.items():
        (src / name).write_bytes(data)
    return src, files


def test_a_local_source_is_read_once_by_both_lanes_of_its_node_and_sent_on_both_rails(tmp_path: Path) -> None:
    src, files = _source(tmp_path, 4, 2 * MiB, 12, "f")
    report = tmp_path / "r.json"
    common = ["--no-progress", "--verify", "--json", str(report)]
    cmd = _mpmd([str(src), str(tmp_path / "A"), *common], [str(src), str(tmp_path / "B"), *common])
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _tree(tmp_path / "A") == files and _tree(tmp_path / "B") == files
    doc = json.loads(report.read_text())
    read = doc["source_bytes_by_rank"]
    assert sum(read) == sum(len(d) for d in files.values())  # the source read once
    assert read[0] > 0 and read[1] > 0  # by both ranks of the reader's node
    assert doc["verified_against_source"] == len(files)


@pytest.mark.parametrize("touched", [0, 1])
def test_a_local_file_a_lane_saw_change_is_sent_again_and_every_lanes_journal_lets_it_go(
    tmp_path: Path, touched: int
) -> None:
    """The reader node's lane 0 or lane 1 sees a file change as it reads it: with the journals on
    (the default), the second round remakes the file on every node after every lane recorded
    and dropped what it wrote of it (before, a lane's journal syncing the leader's new file
    refused it: exit 8 in up to 1 run in 2). Exit 0, both copies the source, sent twice."""
    src, files = _source(tmp_path, 3, 3 * MiB, 6, "t")
    report = tmp_path / "r.json"
    program = [str(Path(__file__).parent / "programs" / "touch_before_read.py")]
    for _ in range(3):  # a race before: each run has its chance
        for dest in ("A", "B"):
            shutil.rmtree(tmp_path / dest, ignore_errors=True)
        slow = {"AZCP_SLOW_JOURNAL_RANK": "1"}  # lane 1's journal late: its writes still unrecorded
        env = clean_env({"AZCP_TOUCH_RANK": str(touched), "AZCP_TOUCH_FILE": "f1.bin", **slow})
        run = [sys.executable, *program]
        cmd = [mpiexec_path(), "-n", "2", *run, str(src), str(tmp_path / "A"), "--no-progress", "--json", str(report),
               ":", "-n", "2", *run, str(src), str(tmp_path / "B"), "--no-progress"]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert _tree(tmp_path / "A") == files and _tree(tmp_path / "B") == files
        doc = json.loads(report.read_text())
        # Sent again: the first round's bytes and the second's.
        assert doc["broadcast_bytes"] > sum(len(d) for d in files.values()), doc["broadcast_bytes"]


@pytest.mark.parametrize("mode", ["streamed", "no-overlap", "verify"])
def test_a_blob_source_goes_out_on_each_lanes_rail_and_leaves_azure_once(
    emulator: azurite.Emulator, tmp_path: Path, mode: str
) -> None:
    container = f"rails{mode.replace('-', '')}{os.getpid()}"
    blobs = {f"d/f{i}.bin": pseudo_random(3 * MiB + 777 * i, f"b{i}") for i in range(5)}
    blobs.update({f"d/small/s{i}.txt": pseudo_random(400 + i, f"t{i}") for i in range(20)})
    azurite.upload(emulator, container, blobs)
    extra = {"streamed": [], "no-overlap": ["--no-overlap"], "verify": ["--verify"]}[mode]
    report = tmp_path / "r.json"
    common = ["--no-progress", "--json", str(report), *extra]
    url = emulator.url(container, "d")
    cmd = _mpmd([url, str(tmp_path / "A"), *common], [url, str(tmp_path / "B"), *common])
    proc = subprocess.run(cmd, env=clean_env(emulator.key_env()), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = {k[2:]: v for k, v in blobs.items()}
    assert _tree(tmp_path / "A") == want and _tree(tmp_path / "B") == want
    doc = json.loads(report.read_text())
    total = sum(len(v) for v in blobs.values())
    assert doc["downloaded_bytes"] == total  # each byte left the service once
    assert doc["broadcast_bytes"] == total  # every rail's bytes counted, once
    assert len(doc["rail_bytes"]) == 2 and sum(doc["rail_bytes"]) == total and all(doc["rail_bytes"]), doc["rail_bytes"]


@pytest.mark.parametrize("how", ["rank-killed", "launcher-interrupted"])
def test_a_lane_1_rank_killed_or_the_launcher_interrupted_mid_copy_ends_the_job_and_the_rerun_completes(
    emulator: azurite.Emulator, tmp_path: Path, how: str
) -> None:
    """SIGKILL to node A's second rank (lane 1), or SIGINT to the launcher, while the copy is
    paced: the job ends within 10 s (a SIGINT with exit 130), nothing under a final name; the
    rerun completes byte-identical."""
    container = f"rails{how.replace('-', '')}{os.getpid()}"
    blobs = {f"d/f{i}.bin": pseudo_random(4 * MiB, f"k{i}") for i in range(6)}
    azurite.upload(emulator, container, blobs)
    url = emulator.url(container, "d")
    dests = [tmp_path / "A", tmp_path / "B"]
    slow = ["--no-progress", "--max-bandwidth", "8MiB/s", "--block-size", "1MiB"]
    cmd = _mpmd([url, str(dests[0]), *slow], [url, str(dests[1]), *slow])
    proc = subprocess.Popen(cmd, env=clean_env(emulator.key_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    victim = None
    deadline = time.monotonic() + 30
    while victim is None and time.monotonic() < deadline:
        time.sleep(0.2)
        victim = _rank_pid(proc.pid, 1)
    assert victim is not None, "rank 1 never started"
    time.sleep(1.5)  # in the middle of the copy (24 MiB at 8 MiB/s)
    if how == "rank-killed":
        os.kill(victim, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGINT)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 10, "the job outlived the signal by 10 s"
    assert proc.returncode != 0, out.decode() + err.decode()
    if how == "launcher-interrupted":
        assert proc.returncode == 130, out.decode() + err.decode()
    for dest in dests:
        assert not any(dest.rglob("f*.bin")), "a final name after a failed run"
    rerun = subprocess.run(_mpmd([url, str(dests[0]), "--no-progress"], [url, str(dests[1]), "--no-progress"]),
                           env=clean_env(emulator.key_env()), capture_output=True, text=True, timeout=180)  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    want = {k[2:]: v for k, v in blobs.items()}
    assert _tree(dests[0]) == want and _tree(dests[1]) == want


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the process below ``launcher`` whose rank is ``rank`` (hydra's PMI_RANK, Open MPI's)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ours = {f"PMI_RANK={rank}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()} & set(environ)
        if b"azcp_cluster" in cmdline and ours and _below(int(entry.name), launcher):
            return int(entry.name)
    return None


def _below(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def test_with_several_rails_the_shards_are_small_enough_for_every_owner() -> None:
    """One large file (a checkpoint) in 1 GiB shards would leave lanes idle: with rails, each
    owner gets about four shards' worth, in whole MiB; with one rail --shard-size stands."""
    from azcp_cluster.core.config import Config
    from azcp_cluster.stages.scheduling import SHARDS_PER_OWNER, shard_size_for

    cfg = Config(source="/src", dest="/d")
    topo = _topo([[0, 1], [2, 3]])
    lanes = Placement(topo, 0, True, 0, (0,), None, rails=2, lane=0, owners=(0, 1))
    alone = Placement(topo, 0, True, 0, (0,), None, rails=1, lane=0, owners=(0,))
    assert shard_size_for(cfg, alone, 100 * 1024 * MiB) == cfg.shard_size
    assert shard_size_for(cfg, lanes, 100 * 1024 * MiB) == cfg.shard_size  # already small enough
    assert shard_size_for(cfg, lanes, 4 * 1024 * MiB) == 512 * MiB  # 4 GiB / (4 x 2 owners)
    assert shard_size_for(cfg, lanes, 3 * MiB) == MiB  # never below a MiB
    size = shard_size_for(cfg, lanes, 1000 * MiB + 1)
    assert size % MiB == 0 and size * SHARDS_PER_OWNER * 2 >= 1000 * MiB


def test_rails_off_runs_the_leaders_one_chain_and_reports_one_rail(tmp_path: Path) -> None:
    """--rails off: one chain (the leaders'), the source read by its one reader, and the report's
    rail_bytes a single entry (not one per lane with the others idle)."""
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i}.bin": pseudo_random(MiB + 313 * i, f"o{i}") for i in range(3)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    report = tmp_path / "r.json"
    common = ["--no-progress", "--rails", "off", "--json", str(report)]
    cmd = _mpmd([str(src), str(tmp_path / "A"), *common], [str(src), str(tmp_path / "B"), *common])
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _tree(tmp_path / "A") == files and _tree(tmp_path / "B") == files
    doc = json.loads(report.read_text())
    total = sum(len(d) for d in files.values())
    assert doc["rail_bytes"] == [total] and doc["source_bytes_by_rank"] == [total, 0, 0, 0], doc


def test_a_lane_that_sees_another_tree_as_source_reads_nothing(tmp_path: Path) -> None:
    """Node A's lane 1 is handed a copy of SOURCE at another path (as a rank in its own mount
    namespace would see another tree): it is no reader, so one chain runs, the reader's tree is
    what every node gets, and only the reader opened SOURCE."""
    src, files = _source(tmp_path, 2, MiB, 3, "x")
    other = tmp_path / "other"
    shutil.copytree(src, other)
    (other / "f0.bin").write_bytes(b"not the source")
    report = tmp_path / "r.json"
    run = [sys.executable, "-m", "azcp_cluster"]
    common = ["--no-progress", "--json", str(report)]
    cmd = [mpiexec_path(), "-n", "1", *run, str(src), str(tmp_path / "A"), *common,
           ":", "-n", "1", *run, str(other), str(tmp_path / "A"), *common,
           ":", "-n", "2", *run, str(src), str(tmp_path / "B"), *common]  # fmt: skip
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _tree(tmp_path / "A") == files and _tree(tmp_path / "B") == files
    doc = json.loads(report.read_text())
    total = sum(len(d) for d in files.values())
    assert doc["source_bytes_by_rank"] == [total, 0, 0, 0] and doc["rail_bytes"] == [total], doc
