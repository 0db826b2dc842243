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
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from azcp_cluster.localfs import final_path, fs_error, is_present
from azcp_cluster.model import FileEntry
from azcp_cluster.naming import MANIFEST_NAME

HASH_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Recorded:
    """One file as the manifest remembers it."""

    size: int
    etag: str
    md5: str  # base64, as Azure reports Content-MD5; "" if unknown


def manifest_path(dest: str) -> str:
    """Where the manifest of ``dest`` lives."""
    return os.path.join(dest, MANIFEST_NAME)


def load(dest: str) -> dict[str, Recorded]:
    """The manifest of ``dest``; empty if there is none or it cannot be read (then nothing matches)."""
    try:
        with open(manifest_path(dest), encoding="utf-8") as fh:
            doc = json.load(fh)
        return {path: Recorded(int(v[0]), str(v[1]), str(v[2])) for path, v in doc["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}


def save(dest: str, files: Sequence[FileEntry], previous: dict[str, Recorded]) -> None:
    """Record ``files`` (all present now), keeping earlier entries whose files still exist."""
    entries = {p: r for p, r in previous.items() if is_present(dest, p, r.size)}
    for f in files:
        entries[f.path] = Recorded(f.size, f.etag, f.content_md5)
    if entries == previous and os.path.exists(manifest_path(dest)):
        return  # a rerun that changed nothing writes nothing (and syncs nothing)
    doc = {"version": 1, "files": {p: [r.size, r.etag, r.md5] for p, r in sorted(entries.items())}}
    path = manifest_path(dest)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, separators=(",", ":"), ensure_ascii=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise fs_error(exc, path, "write the manifest") from None


def md5_of(path: str) -> str:
    """Base64 MD5 of a file, read in large chunks (hashlib releases the GIL on each)."""
    digest = hashlib.md5(usedforsecurity=False)
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return base64.b64encode(digest.digest()).decode("ascii")


def present(dest: str, files: Sequence[FileEntry], mode: str) -> list[bool]:
    """For each file, whether this rank's copy counts as present under ``--compare mode``."""
    if mode == "none":
        return [False] * len(files)
    sized = [is_present(dest, f.path, f.size) for f in files]
    if mode == "size":
        return sized
    recorded = load(dest)
    if mode == "etag":
        return [
            ok and bool(f.etag) and f.path in recorded and recorded[f.path].etag == f.etag
            for ok, f in zip(sized, files, strict=True)
        ]

    # md5: the blob's own Content-MD5, else the one recorded for the same ETag.
    def expected(f: FileEntry) -> str:
        if f.content_md5:
            return f.content_md5
        rec = recorded.get(f.path)
        return rec.md5 if rec is not None and rec.etag == f.etag else ""

    candidates = [i for i, f in enumerate(files) if sized[i] and expected(f)]
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="azcp-md5") as pool:
        digests = list(pool.map(lambda i: md5_of(final_path(dest, files[i].path)), candidates))
    result = [False] * len(files)
    for i, digest in zip(candidates, digests, strict=True):
        result[i] = digest == expected(files[i])
    return result
