"""Ceilings for the broadcast stage, measured on the same ranks: run under mpiexec.

    mpiexec -n 4 python benchmarks/raw_bcast.py --bytes N --chunk C --dir D --json OUT

* bcast: plain blocking ``MPI_Bcast`` of ``--bytes`` in ``--chunk`` pieces, roots taking
  turns, from and into one page-aligned buffer (no disk): MiB/s per receiver.
* write: every rank at once writes ``--bytes`` with O_DIRECT into its own file under
  ``--dir`` in ``--chunk`` pieces, then fsyncs: MiB/s per rank (the slowest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI

from azcp_cluster.core.schedule import call_slices
from azcp_cluster.dest.directio import aligned_buffer


def main() -> int:
    """Measure both ceilings and write them (rank 0) as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--chunk", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = aligned_buffer(args.chunk)
    buf[:] = rank
    chunks = [(off, min(args.chunk, args.bytes - off)) for off in range(0, args.bytes, args.chunk)]

    comm.Barrier()
    started = time.perf_counter()
    for i, (_, length) in enumerate(chunks):
        for a, b in call_slices(length):
            comm.Bcast([buf[a:b], MPI.BYTE], root=i % size)
    comm.Barrier()
    bcast_seconds = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)

    path = os.path.join(args.dir, f"raw-write-{rank}.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    comm.Barrier()
    started = time.perf_counter()
    try:
        for off, length in chunks:
            os.pwrite(fd, buf[: -(-length // 4096) * 4096].data, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_seconds = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
    os.unlink(path)
    if rank == 0:
        mib = args.bytes / 2**20
        Path(args.json).write_text(
            json.dumps({"bcast": mib / bcast_seconds, "write": mib / write_seconds, "ranks": size}) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
