"""--verify's digests: each file's MD5 hashed as its bytes stream past, and the verdict on
every node's MD5 of every file it holds, against the blob's and each other. Pure code."""

from __future__ import annotations

import base64
import hashlib
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from azcp_cluster.core.crc import crc32
from azcp_cluster.core.errors import VerifyError
from azcp_cluster.core.model import FileEntry


def verdict(files: Sequence[FileEntry], reports: Sequence[tuple[int, Mapping[int, str]]]) -> dict[int, str]:
    """The MD5 every copy of each file has, or :class:`VerifyError` naming the file and the ranks that differ.

    ``reports`` holds each node's leader and the MD5 it found of each file its node holds
    (file index -> base64 MD5): with the usual schedule every node holds every file; with a
    subset of receivers, only some do, and only those are compared. A file's expected MD5 is
    its Content-MD5 when the source gave one, else the one most copies have.
    """
    agreed: dict[int, str] = {}
    for index, entry in enumerate(files):
        seen = [(rank, digests[index]) for rank, digests in reports if index in digests]
        if not seen:
            continue
        expected = entry.content_md5 or Counter(d for _, d in seen).most_common(1)[0][0]
        bad = [rank for rank, digest in seen if digest != expected]
        if bad:
            ranks = ", ".join(map(str, bad))
            against = "the blob's Content-MD5" if entry.content_md5 else "the other ranks"
            raise VerifyError(f"MD5 on rank(s) {ranks} differs from {against}", path=entry.path)
        agreed[index] = expected
    return agreed


def against_source(
    files: Sequence[FileEntry],
    reports: Sequence[tuple[int, Mapping[int, int]]],
    source: Mapping[int, int],
    conflicting: Collection[int] = (),
) -> int:
    """Check every copy read back against the CRC-32 of its file's bytes as they came from the
    source (``source``: file index -> CRC, core.crc.expected); :class:`VerifyError` naming the
    file and the nodes whose copy differs. ``reports``: each node's leader and the CRC it read
    back of each file it holds. Returns how many files were checked so.

    The check that needs no Content-MD5 and no other node: a copy that a disk, a filesystem,
    a hop or a resumed block changed is caught even where every node holds the same wrong bytes.
    A file in ``conflicting`` (its bytes came from the source twice, with other CRCs) fails.
    """
    for index in sorted(conflicting):
        if any(index in crcs for _, crcs in reports):
            raise VerifyError(
                "the bytes of it that came into the run disagree with each other (CRC-32): a block changed "
                "on a disk or on the way",
                path=files[index].path,
            )
    checked = 0
    for index, entry in enumerate(files):
        want = source.get(index)
        if want is None:
            continue
        seen = [(rank, crcs[index]) for rank, crcs in reports if index in crcs]
        bad = [rank for rank, crc in seen if crc != want]
        if bad:
            raise VerifyError(
                f"the copy on rank(s) {', '.join(map(str, bad))} differs from the bytes as they came from the "
                "source (CRC-32)",
                path=entry.path,
            )
        checked += bool(seen)
    return checked


class StreamDigests:
    """The MD5 of files whose bytes arrive in offset order, a piece at a time (``--verify stream``).

    ``add`` each file's pieces in order, the last one with ``last``; ``digests`` then holds
    its MD5 (base64, as Content-MD5 has it), and ``crcs``, if given, its CRC-32 (what
    ``--verify stream`` checks against the source's, as ``disk`` checks the read-back's).
    Files may interleave; one caller at a time.
    """

    def __init__(self, digests: dict[int, str] | None = None, crcs: dict[int, int] | None = None) -> None:
        self.digests = digests if digests is not None else {}  # file index -> base64 MD5
        self.crcs = crcs
        self._open: dict[int, tuple[hashlib._Hash, int]] = {}

    def add(self, file: int, data: bytes | memoryview, last: bool) -> None:
        """Hash ``data``, the next bytes of ``file``; ``last``: its last ones."""
        md5, crc = self._open.get(file) or (hashlib.md5(usedforsecurity=False), 0)
        md5.update(data)
        if self.crcs is not None:
            crc = crc32(data, crc)
        if last:
            self._open.pop(file, None)
            self.digests[file] = base64.b64encode(md5.digest()).decode("ascii")
            if self.crcs is not None:
                self.crcs[file] = crc
        else:
            self._open[file] = (md5, crc)


__all__ = ["StreamDigests", "against_source", "verdict"]
