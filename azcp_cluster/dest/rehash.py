"""Kept blocks read back and checked: a stopped run's journalled ranges are believed only if
their bytes on the disk still have the CRC-32 they were recorded with (journal.load).

A range's CRC is of its bytes as they arrived (a downloaded block from its buffers, a fan-out
extent from its slot). A sector that flipped on the disk since, another writer, a range claimed
in error: its CRC no longer matches, and it is fetched again instead of trusted and sent on to
the other nodes (issue 38). The reads are O_DIRECT where the filesystem allows (the disk's
bytes, not the page cache's), CHECK_THREADS files at once, each in CHECK_CHUNK pieces (the
reads and crc32 release the GIL): about 0.04 s of a core per GiB besides the reads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from azcp_cluster.core.crc import crc32
from azcp_cluster.core.errors import LocalFSError
from azcp_cluster.core.resume import Claim
from azcp_cluster.dest.destroot import identity
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectReader, Opener, aligned_buffer
from azcp_cluster.dest.localfs import temp_name
from azcp_cluster.run.interrupts import shield

CHECK_CHUNK = 8 * 1024 * 1024  # one O_DIRECT read per CRC update: large enough to stream a disk
CHECK_THREADS = 4  # reads queued on the disk at once, as the read-back's hash_files does
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_buffers = threading.local()


def check_all(tree: DestTree, jobs: Sequence[tuple[str, int, Sequence[Claim]]]) -> list[list[Claim]]:
    """For each (path below DEST, its temporary file's identity, the claims on it), the claims
    whose bytes still match (:func:`checked`), CHECK_THREADS files at once; interrupted (a
    signal, an error), the files not started yet are dropped."""
    pool = ThreadPoolExecutor(max_workers=CHECK_THREADS, thread_name_prefix="azcp-rehash", initializer=shield)
    stop = threading.Event()  # the files being read stop at their next piece
    try:
        return list(pool.map(lambda job: checked(tree, job[0], job[1], job[2], stop), jobs))
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)


def temp_opener(tree: DestTree, rel: str) -> Opener:
    """An opener of ``rel``'s temporary file below DEST from a stopped run (the current run's
    ``DestTree.made`` does not know it): each directory walked without links, the file itself
    never through one, never blocking on a FIFO."""
    head, _, base = rel.rpartition("/")

    def opener(flags: int) -> int:
        with tree.directory(head.split("/") if head else []) as dfd:
            return os.open(temp_name(base), flags | _FILE_FLAGS, dir_fd=dfd)

    return opener


def checked(
    tree: DestTree, rel: str, ident: int, found: Sequence[Claim], stop: threading.Event | None = None
) -> list[Claim]:
    """The claims on ``rel``'s temporary file (the one of identity ``ident``) whose bytes, read
    back now, still have the recorded CRC-32, in offset order. None is kept if the file cannot
    be read or is not that file any more, or once ``stop`` is set (a signal: nothing is kept)."""
    buf: np.ndarray | None = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = aligned_buffer(CHECK_CHUNK)
    try:
        reader = DirectReader("", direct=True, opener=temp_opener(tree, rel))
    except (OSError, LocalFSError):
        return []
    good = []
    try:
        if identity(os.fstat(reader.fd)) != ident:
            return []
        for claim in sorted(set(found)):
            crc, offset, end = 0, claim.offset, claim.offset + claim.length
            while offset < end:
                if stop is not None and stop.is_set():
                    return []
                want = min(CHECK_CHUNK, end - offset)
                got = reader.read_at(buf, want, offset)
                crc = crc32(memoryview(buf[:got]), crc)  # type: ignore[arg-type]
                if got < want:
                    break  # shorter than claimed: cannot match
                offset += got
            if offset >= end and crc == claim.crc:
                good.append(claim)
    except OSError:
        return []  # unreadable: nothing of it is believed (the copy makes it anew)
    finally:
        reader.close()
    return good


__all__ = ["CHECK_CHUNK", "CHECK_THREADS", "check_all", "checked"]
