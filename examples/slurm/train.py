"""A stand-in for your training script: every process reads the node's staged copy of the weights.

Launched by torchrun (download-then-train.sbatch, apptainer.sbatch, examples/aks/):

    torchrun --nnodes=N --nproc-per-node=8 ... train.py --weights /mnt/nvme/models/llama-3-8b

Each process lists the weights directory, reads the files it is given (a share of them, so
the node reads each file once) and the processes agree, with one all-reduce, on how many
files and bytes they saw: a node with a missing or short copy makes every rank fail here,
before any GPU time is spent. Replace the body of ``main`` with the real model loading and
training loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist


def read_share(root: Path, local_rank: int, local_size: int) -> tuple[int, int, int]:
    """Files, bytes and a CRC32 sum of this process's share of the files under ``root``."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    count = size = crc = 0
    for path in files[local_rank::local_size]:
        value = 0
        with path.open("rb") as fh:
            while block := fh.read(16 << 20):
                value = zlib.crc32(block, value)
                size += len(block)
        crc = (crc + value) % (1 << 31)
        count += 1
    return count, size, crc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", required=True, type=Path, help="the staged directory on local disk")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)

    # Every process reads its share of the node's copy; the shares of one node add up to
    # that node's files, bytes and CRC sum, which must be the same on every node.
    mine = torch.tensor(read_share(args.weights, local_rank, local_size), dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    nodes = world // local_size  # torchrun numbers the processes node by node
    per_node = [torch.stack(gathered[n * local_size : (n + 1) * local_size]).sum(0).tolist() for n in range(nodes)]
    if any(p != per_node[0] for p in per_node):
        if rank == 0:
            print(f"train.py: the nodes' copies of {args.weights} differ: {per_node}", file=sys.stderr)
        dist.destroy_process_group()
        return 1
    if rank == 0:
        files, nbytes, _ = per_node[0]
        print(f"train.py: {nodes} node(s) x {files} files, {nbytes} bytes each under {args.weights}: identical")
    # ... load the model from args.weights and train ...
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
