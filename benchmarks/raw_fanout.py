"""Raw fan-out patterns, no disk and no tool: run under mpiexec with one rank per host.

    mpiexec ... python benchmarks/raw_fanout.py --pattern ibcast|chain|ring --bytes N --piece P
                                                [--inflight K] [--chains R] --json OUT

* ibcast: rank 0's ``--bytes`` in ``--piece`` pieces, each a nonblocking ``MPI_Ibcast``, up
  to ``--inflight`` at once (the oldest completed before the next is posted): the pattern the
  tool's fan-out uses.
* chain: a pipelined point-to-point chain 0 -> 1 -> ... -> N-1: each rank pre-posts
  ``--inflight`` receives from the rank before it and forwards every piece to the rank after it
  as soon as it has arrived. Every link carries the bytes once, so on links of one rate it
  takes about S/B, whatever N.
* ring: the bytes spread, rank r holding the r-th of N equal parts (what a sharded download
  leaves); every part travels N-1 hops around the ring r -> r+1 -> ..., each rank forwarding
  what its predecessor sends except what its successor started. Every link carries
  S(N-1)/N: the streaming fan-out's bound, S(N-1)/(N B), and this machine's ceiling for it
  (no disk, no download, no tool).

``--chains R`` (R ranks per host, each bound to its own rail): R patterns at once, local rank
i of every host in the i-th, each over 1/R of the bytes (a chain per rail: every rail carries
its share once, S/(R·B)).

Rank 0 writes the seconds between two barriers (the slowest rank's) as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI


def ibcast(comm: Any, buf: np.ndarray, pieces: list[tuple[int, int]], inflight: int) -> None:
    """Every piece from rank 0 by Ibcast, ``inflight`` at once."""
    window: deque[Any] = deque()
    for offset, length in pieces:
        if len(window) == inflight:
            window.popleft().Wait()
        window.append(comm.Ibcast([buf[offset : offset + length], MPI.BYTE], root=0))
    MPI.Request.Waitall(list(window))


def chain(comm: Any, buf: np.ndarray, pieces: list[tuple[int, int]], inflight: int) -> None:
    """Every piece along the chain 0 -> 1 -> ... -> N-1, receives pre-posted ``inflight`` deep."""
    rank, size = comm.Get_rank(), comm.Get_size()
    before, after = rank - 1, rank + 1 if rank + 1 < size else None
    sends: list[Any] = []

    def receive(i: int) -> Any:
        offset, length = pieces[i]
        return comm.Irecv([buf[offset : offset + length], MPI.BYTE], source=before, tag=i)

    posted: deque[Any] = deque(receive(i) for i in range(min(inflight, len(pieces)))) if rank else deque()
    for i, (offset, length) in enumerate(pieces):
        if rank:
            posted.popleft().Wait()
            if i + inflight < len(pieces):
                posted.append(receive(i + inflight))
        if after is not None:
            sends.append(comm.Isend([buf[offset : offset + length], MPI.BYTE], dest=after, tag=i))
            if len(sends) > inflight:  # completed in order: the oldest is the first to finish
                sends.pop(0).Wait()
    MPI.Request.Waitall(sends)


def ring(comm: Any, buf: np.ndarray, pieces: list[tuple[int, int]], inflight: int) -> None:
    """Every rank's part around the ring; ``pieces`` cut one part (every part alike)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    before, after = (rank - 1) % size, (rank + 1) % size
    part = len(buf) // size
    per_part = len(pieces)
    total = (size - 1) * per_part  # messages each rank sends, and receives

    def span(owner: int, j: int) -> np.ndarray:
        offset, length = pieces[j]
        return buf[owner * part + offset : owner * part + offset + length]

    # Message i = k * per_part + j: the j-th piece of the part that started k hops back.
    # Every receive is posted at once (a ring of rendezvous sends, each waiting for its
    # successor's receive, would otherwise deadlock); sends stay ``inflight`` deep.
    receives = deque(
        comm.Irecv([span((rank - 1 - i // per_part) % size, i % per_part), MPI.BYTE], source=before, tag=i)
        for i in range(total)
    )
    arrived = 0
    sends: deque[Any] = deque()
    for i in range(total):
        k, j = divmod(i, per_part)
        if k:
            while arrived <= i - per_part:  # what this message forwards has arrived
                receives.popleft().Wait()
                arrived += 1
        sends.append(comm.Isend([span((rank - k) % size, j), MPI.BYTE], dest=after, tag=i))
        if len(sends) > inflight:
            sends.popleft().Wait()
    MPI.Request.Waitall(list(receives) + list(sends))


def main() -> int:
    """Time one pattern; rank 0 writes its figures (seconds, every rank's CPU seconds) as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pattern", choices=("ibcast", "chain", "ring"), required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--piece", type=int, default=4 << 20)
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--chains", type=int, default=1, help="R patterns at once, one per rail")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    world = comm = MPI.COMM_WORLD
    total, local = args.bytes, 0
    if args.chains > 1:  # local rank i of every host in the i-th pattern, over the i-th share of the bytes
        local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        if local >= args.chains:
            raise SystemExit(f"--chains {args.chains}: local rank {local}; launch as many ranks per host as chains")
        comm = world.Split(local, world.Get_rank())
        args.bytes = total // args.chains + (1 if local < total % args.chains else 0)
    rank, size = comm.Get_rank(), comm.Get_size()
    whole = np.frombuffer(np.random.default_rng(1 + local).bytes(args.bytes), dtype=np.uint8)
    buf = np.zeros(args.bytes, dtype=np.uint8)
    if args.pattern == "ring":
        if args.bytes % (8 * size):
            raise SystemExit("ring: --bytes must be a multiple of 8 x the ranks")
        part = args.bytes // size
        buf[rank * part : (rank + 1) * part] = whole[rank * part : (rank + 1) * part]  # this rank's share
        cut = part
    else:
        if rank == 0:
            buf[:] = whole
        cut = args.bytes
    pieces = [(off, min(args.piece, cut - off)) for off in range(0, cut, args.piece)]
    run = {"ibcast": ibcast, "chain": chain, "ring": ring}[args.pattern]
    world.Barrier()
    started, cpu = time.perf_counter(), time.process_time()
    run(comm, buf, pieces, args.inflight)
    world.Barrier()
    seconds = world.allreduce(time.perf_counter() - started, op=MPI.MAX)
    # Every rank's CPU time: an MPI that busy-polls while it waits takes all it is given.
    cpu_seconds = world.allreduce(time.process_time() - cpu, op=MPI.SUM)
    # Every rank holds the whole (a pattern that lost or reordered a piece is no ceiling).
    same = world.allreduce(int(np.array_equal(buf, whole)), op=MPI.MIN) == 1
    if world.Get_rank() == 0:
        figures = {"pattern": args.pattern, "bytes": total, "piece": args.piece, "inflight": args.inflight,
                   "ranks": world.Get_size(), "chains": args.chains, "seconds": seconds, "cpu_s": cpu_seconds,
                   "intact": same}  # fmt: skip
        Path(args.json).write_text(json.dumps(figures) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
