"""One rank's broadcast, instrumented: is a chunk written while the owner's next read runs?

    mpiexec -n 1 python tests/programs/driver_progress.py WORKDIR

A local source of three chunks on one rank (which, reading a local SOURCE, writes its
own copy like a receiver). The read of the second chunk waits, at most 10 s, for the
first chunk's write to begin. A driver whose MPI thread sat waiting for that read
before it passed the finished first chunk on would keep the write from starting, and the
read would give up waiting. Prints one JSON line: whether the write came first, and
whether the copy is whole.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import numpy as np
from mpi4py import MPI

from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.schedule import Extent, Transfer
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectFile, DirectReader
from azcp_cluster.dest.localfs import temp_path
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.fanout.driver import FanOutDriver
from azcp_cluster.fanout.transport import MpiTransport

CHUNK = 1 << 20


def main() -> int:
    """Run the broadcast and print what was seen."""
    work = sys.argv[1]
    data = os.urandom(3 * CHUNK)
    source = os.path.join(work, "source.bin")
    with open(source, "wb") as fh:
        fh.write(data)
    dest = os.path.join(work, "dest")
    os.makedirs(dest)
    tree = DestTree(dest)
    tree.prepare("f.bin", len(data))
    first_written = threading.Event()
    seen: dict[str, Any] = {}
    write_at, read_at = DirectFile.write_at, DirectReader.read_at

    def writing(self: DirectFile, buf: np.ndarray, offset: int) -> int:
        if offset == 0:
            first_written.set()
        return write_at(self, buf, offset)

    def reading(self: DirectReader, buf: np.ndarray, length: int, offset: int) -> int:
        if offset == CHUNK:
            seen["written_before_next_read"] = first_written.wait(timeout=10)
        return read_at(self, buf, length, offset)

    DirectFile.write_at = writing  # type: ignore[method-assign]
    DirectReader.read_at = reading  # type: ignore[method-assign]
    files = [FileEntry(name="f.bin", path="f.bin", size=len(data))]
    chunks = [
        Transfer(i, 0, (), (Extent(0, i * CHUNK, CHUNK, 0, last_of_file=i == 2),), everyone=True) for i in range(3)
    ]
    with NodeWriter(files, tree, 1) as writer:
        driver = FanOutDriver(
            MpiTransport(MPI.COMM_WORLD), files, tree, CHUNK, writer, pipeline=4, writers=1, source_of=lambda i: source
        )
        driver.run(chunks)
    with open(temp_path(dest, "f.bin"), "rb") as fh:
        seen["whole"] = fh.read() == data
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
