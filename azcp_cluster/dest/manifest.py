"""What a rank knows about its copies: the manifest in DEST, and the ``--compare`` checks.

After a successful run every rank records, in ``DEST/.azcp-manifest.json``, each file's
size, ETag and MD5 as listed. The next run can then skip a file only if its ETag is still the
listed one (``--compare etag``: catches a blob replaced by one of the same size without
reading any data), or after hashing it (``--compare md5``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import numpy as np

from azcp_cluster.core.crc import crc32
from azcp_cluster.core.errors import DiffError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.naming import MANIFEST_NAME
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectReader, Opener, aligned_buffer
from azcp_cluster.run.interrupts import shield

HASH_CHUNK = 8 * 1024 * 1024  # one O_DIRECT read per hash update: large enough to stream a disk
T = TypeVar("T")
# A manifest larger than this is not one the tool wrote (about 100 bytes a file).
MANIFEST_LIMIT = 1 << 30


class Recorded(NamedTuple):
    """One file as the manifest remembers it (a named tuple: a manifest of 100,000 files is
    read in every rerun, and these cost a third of a frozen dataclass to make)."""

    size: int
    etag: str
    md5: str  # base64, as Azure reports Content-MD5; "" if unknown


def load(tree: DestTree) -> dict[str, Recorded]:
    """The manifest of DEST; empty if there is none or it cannot be read (then nothing matches)."""
    data = tree.read_small(MANIFEST_NAME, MANIFEST_LIMIT)
    if data is None:
        return {}
    try:
        doc = json.loads(data.decode("utf-8"))
        return {path: Recorded(int(v[0]), str(v[1]), str(v[2])) for path, v in doc["files"].items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return {}


def same_etag(recorded: str, listed: str) -> bool:
    """Whether what the manifest recorded under ``recorded`` (a copy for ``--compare etag``, an
    MD5 for ``--compare md5``) is of the version listed.

    Weakly: a local file's weak ETag (``W/``, localsource.py) matches its strong form. A
    whole copy is then taken for current unless the file changed since, which only a change
    within the filesystem's timestamp granularity of the recorded one hides (a stale copy,
    never a torn one; the block journal, which could mix versions, never takes a weak ETag).
    """
    return recorded.removeprefix("W/") == listed.removeprefix("W/")


def save(
    tree: DestTree, files: Sequence[FileEntry], previous: dict[str, Recorded], present: Mapping[str, int] | None = None
) -> None:
    """Record ``files`` (all present now), keeping earlier entries whose files still exist.

    ``present``: path -> size of the files this run's compare found in DEST (and left
    there): an earlier entry of one of these, of that size, is kept without looking again
    (a no-op rerun of 100,000 files: 100,000 stat calls fewer). The others are looked at.
    """
    known = present or {}
    unsure = [(p, r.size) for p, r in previous.items() if known.get(p) != r.size]
    gone = {p for (p, _), ok in zip(unsure, tree.present_all(unsure), strict=True) if not ok}
    entries = {p: r for p, r in previous.items() if p not in gone}
    changed = bool(gone)
    for f in files:
        md5 = f.content_md5
        old = previous.get(f.path)
        if not md5 and old is not None and old.size == f.size and same_etag(old.etag, f.etag):
            md5 = old.md5  # the same version: an MD5 found earlier (by --verify) still holds
        entry = Recorded(f.size, f.etag, md5)
        changed = changed or entries.get(f.path) != entry
        entries[f.path] = entry
    if not changed and tree.lstat(MANIFEST_NAME) is not None:
        return  # a rerun that changed nothing writes nothing (and syncs nothing)
    doc = {"version": 1, "files": {p: [r.size, r.etag, r.md5] for p, r in sorted(entries.items())}}
    tree.write_atomic(MANIFEST_NAME, json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


_buffers = threading.local()  # one aligned read buffer per hashing thread


def md5_of(opener: Opener, direct: bool = False) -> str:
    """Base64 MD5 of a file, read in large chunks (hashlib releases the GIL on each).

    ``direct``: read with O_DIRECT (where the filesystem allows), so the hash is of what is
    on the disk, not of pages still in the cache, and the read leaves nothing cached.
    """
    return digests_of(opener, direct, crc=False)[0]


def digests_of(opener: Opener, direct: bool = False, crc: bool = True) -> tuple[str, int]:
    """A file's base64 MD5 and, with ``crc``, its CRC-32 (0 without), in one read (see :func:`md5_of`)."""
    buf: np.ndarray | None = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = aligned_buffer(HASH_CHUNK)
    digest = hashlib.md5(usedforsecurity=False)
    value = 0
    reader = DirectReader("", direct=direct, opener=opener)
    try:
        offset = 0
        while True:
            got = reader.read_at(buf, HASH_CHUNK, offset)
            view = memoryview(buf[:got])  # type: ignore[arg-type]
            digest.update(view)
            if crc:
                value = crc32(view, value)
            if got < HASH_CHUNK:
                break
            offset += got
    finally:
        reader.close()
    return base64.b64encode(digest.digest()).decode("ascii"), value


def hash_files(digest: Callable[[int], T], indices: list[int], threads: int = 4) -> list[T]:
    """``digest`` of every index, ``threads`` files at once (hashlib and the reads release the GIL).

    Interrupted (a signal, an error), it drops the files not started yet instead of hashing
    them all before the exception goes on.
    """
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="azcp-md5", initializer=shield)
    try:
        return list(pool.map(digest, indices))
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)


def _local_md5(tree: DestTree, rel: str) -> str:
    try:
        return md5_of(tree.opener(rel, temp=False))
    except OSError as exc:
        raise DiffError(f"cannot read the local copy: {exc.strerror or exc}", path=tree.shown(rel)) from None


def present(tree: DestTree, files: Sequence[FileEntry], mode: str) -> list[bool]:
    """For each file, whether this rank's copy counts as present under ``--compare mode``."""
    if mode == "none":
        return [False] * len(files)
    sized = tree.present_all((f.path, f.size) for f in files)
    if mode == "size":
        return sized
    recorded = load(tree)
    if mode == "etag":
        return [
            ok and bool(f.etag) and f.path in recorded and same_etag(recorded[f.path].etag, f.etag)
            for ok, f in zip(sized, files, strict=True)
        ]

    # md5: the blob's own Content-MD5, else the one recorded for the same ETag.
    def expected(f: FileEntry) -> str:
        if f.content_md5:
            return f.content_md5
        rec = recorded.get(f.path)
        return rec.md5 if rec is not None and same_etag(rec.etag, f.etag) else ""

    candidates = [i for i, f in enumerate(files) if sized[i] and expected(f)]
    digests = hash_files(lambda i: _local_md5(tree, files[i].path), candidates)
    result = [False] * len(files)
    for i, digest in zip(candidates, digests, strict=True):
        result[i] = digest == expected(files[i])
    return result
