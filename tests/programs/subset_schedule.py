"""A schedule whose receivers are a subset, through the real engine: a scatter/replica mode is a schedule.

    mpiexec -n 3 python tests/programs/subset_schedule.py WORKDIR [ibcast|chain]

Rank 0 reads three local files (a small one, one of several transfers, one packed with
the small one) and is every transfer's root, over MPI's calls (ibcast, the default) or a
chain of 256 KiB pieces. File 0 goes to rank 1 only, file 1 to rank 2
only, file 2 to both; the schedule says so and nothing else does. Each rank writes
WORKDIR/result<rank>.json: which temporary files it wrote and whether each is byte-identical to the source.
"""

from __future__ import annotations

import json
import os
import sys

from mpi4py import MPI

from azcp_cluster.core.chain import choose
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.packing import transfer_schedule
from azcp_cluster.core.plan import make_plan
from azcp_cluster.core.schedule import files_written
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.localfs import temp_path
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.fanout.chain import transport_for
from azcp_cluster.fanout.driver import FanOutDriver
from azcp_cluster.fanout.transport import MpiTransport

SIZES = [5000, 3 * (1 << 20) + 123, 70_000]
RECEIVERS = {0: (1,), 1: (2,), 2: (1, 2)}


def main() -> int:
    """Run the fan-out of the subset schedule and write what this rank has to result<rank>.json."""
    work = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sources = [os.path.join(work, "src", f"f{i}.bin") for i in range(len(SIZES))]
    if rank == 0:
        os.makedirs(os.path.join(work, "src"), exist_ok=True)
        for i, (path, size) in enumerate(zip(sources, SIZES, strict=True)):
            with open(path, "wb") as fh:
                fh.write(bytes((i * 7 + k) % 251 for k in range(size)))
    comm.Barrier()
    files = [FileEntry(name=f"f{i}.bin", path=f"f{i}.bin", size=size) for i, size in enumerate(SIZES)]
    plan = make_plan(SIZES, range(len(SIZES)), 1, 1 << 30)
    schedule = transfer_schedule(plan, 1 << 20, 3, receivers_of=lambda file, root: RECEIVERS[file])
    dest = os.path.join(work, f"dest{rank}")
    os.makedirs(dest, exist_ok=True)
    tree = DestTree(dest)
    # What this node writes, asked of the schedule (as the pipeline's allocate does); the
    # reader writes its own copy of what it reads, like a local SOURCE's reader.
    mine = sorted(files_written(schedule, rank))
    tree.prepare_all([(files[i].path, files[i].size) for i in mine])
    local = {i: sources[i] for i in range(len(SIZES))}
    method = sys.argv[2] if len(sys.argv) > 2 else "ibcast"
    writer = NodeWriter(files, tree, 2)
    driver = FanOutDriver(
        transport_for(MpiTransport(comm), choose(method, 3, 0, piece=256 * 1024)),
        files,
        tree,
        max(t.length for t in schedule),
        writer,
        pipeline=2,
        writers=2,
        source_of=(lambda i: None) if rank else local.get,
        verify=True,
    )
    with writer:
        stats = driver.run(schedule)
    have = {}
    for i in range(len(SIZES)):
        path = temp_path(dest, files[i].path)
        if os.path.exists(path):
            with open(path, "rb") as got, open(sources[i], "rb") as want:
                have[i] = got.read() == want.read()
    # One file per rank: lines that several ranks print to one stdout can run together.
    with open(os.path.join(work, f"result{rank}.json"), "w") as fh:
        json.dump(
            {
                "rank": rank,
                "have": {str(k): v for k, v in have.items()},
                "transfers": stats.chunks,
                "p2p": sum(1 for t in schedule if not t.everyone),
                "digests": sorted(driver.digests),
            },
            fh,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
