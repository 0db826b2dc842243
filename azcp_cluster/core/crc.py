"""The block hash, CRC-32 (zlib's), and its arithmetic: two ranges' CRCs combined into the CRC
of both, and a file's CRC composed from the CRCs of ranges that tile it.

Every block is hashed where it enters a run (a ranged GET's body as it arrives, a local
SOURCE's bytes as they are read, a kept block as the journal recorded it and the rerun
checked it), with the boundaries of whatever brought it. ``--verify`` composes, for each
file, the CRC of the bytes as they came from the source out of those pieces, and compares
each node's read-back with it (stages.finish.verify, core.digests.verdict): the same bytes
cut at other places give the same CRC, since a CRC of a concatenation follows from the
CRCs of its parts (:func:`combine`, as zlib's crc32_combine does it).

:func:`crc32` is ISA-L's (the ``isal`` package): the same values as ``zlib.crc32``, folded
with carry-less multiplies (VPCLMULQDQ where the CPU has it), 0.013 to 0.015 s of a core
per GiB in cache here, where ``zlib.crc32`` takes 0.21 and CRC-32C (``crc32c``, SSE 4.2)
0.037; from memory all are bound by it (0.04). The download hashes each socket read as it
lands: in cache over HTTPS, partly from memory over HTTP, whose reads fill whole 2 MiB
buffers (docs/benchmarks.md, "What integrity costs"). It releases the GIL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

from isal.isal_zlib import crc32

POLY = 0xEDB88320  # CRC-32 (zlib's, ISO-HDLC), reflected


def _multmodp(a: int, b: int) -> int:
    """a(x) b(x) modulo the polynomial, in the reflected bit order of the CRC."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


def _table() -> list[int]:
    # x^(2^k) modulo the polynomial, k = 0..31 (x^1 is 1 << 30 in the reflected order).
    out = [1 << 30]
    for _ in range(31):
        out.append(_multmodp(out[-1], out[-1]))
    return out


_X2N = _table()


@lru_cache(maxsize=256)  # a copy's ranges have a few distinct lengths
def _shift(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial."""
    p = 1 << 31  # x^0
    k = 3  # 8 = 2^3 bits a byte
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A followed by B, from A's CRC ``crc1``, B's ``crc2`` and B's length ``len2``."""
    if len2 <= 0 or crc1 == 0:
        return crc2 if len2 > 0 else crc1  # (a product with 0 is 0: the CRC of A adds nothing)
    return _multmodp(_shift(len2), crc1) ^ crc2


def compose(size: int, pieces: Iterable[tuple[int, int, int]]) -> int | None:
    """The CRC-32 of a file of ``size`` bytes from ``pieces`` (offset, length, CRC of those
    bytes), which may overlap and be cut anywhere: the CRC along pieces that run end to end
    from 0 to ``size``. None when no such run exists, or when pieces disagree (no CRC of "the
    source's bytes" can be told; :func:`disagree` says so).
    """
    return _walk(size, list(pieces))[0]


def disagree(size: int, pieces: Iterable[tuple[int, int, int]]) -> bool:
    """Whether ``pieces`` of a file of ``size`` bytes give two CRCs for the same bytes: two
    pieces of one range, or two runs from the file's start that meet with different CRCs."""
    pieces = list(pieces)
    return _twice(pieces) or _walk(size, pieces)[1]


def _twice(pieces: Sequence[tuple[int, int, int]]) -> bool:
    """Whether two pieces of one range have different CRCs."""
    seen: dict[tuple[int, int], int] = {}
    return any(seen.setdefault((offset, length), crc) != crc for offset, length, crc in pieces)


def _walk(size: int, pieces: list[tuple[int, int, int]]) -> tuple[int | None, bool]:
    """(compose's answer, whether two runs from 0 met with different CRCs)."""
    if size == 0:
        return 0, False
    if len(pieces) == 1 and pieces[0][:2] == (0, size):  # a small file, one piece: most of a big listing
        return pieces[0][2], False
    starting: dict[int, list[tuple[int, int]]] = {}
    for offset, length, crc in pieces:
        if length > 0 and offset >= 0 and offset + length <= size:
            starting.setdefault(offset, []).append((offset + length, crc))
    reached: dict[int, int] = {0: 0}  # offset -> CRC of the bytes before it
    for offset in sorted(starting):  # every piece ends after it starts: offsets in order suffice
        before = reached.get(offset)
        if before is None:
            continue
        for end, crc in starting[offset]:
            got = combine(before, crc, end - offset)
            if reached.setdefault(end, got) != got:
                return None, True
    return reached.get(size), False


class SourcePieces:
    """One rank's record of the pieces it brought into the run, each with the CRC-32 of its
    bytes as they came from the source: (file, offset, length, crc). Appended to from the
    download's thread and the read-ahead thread (a list's append is atomic)."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, int, int, int]] = []

    def add(self, file: int, offset: int, length: int, crc: int) -> None:
        """``length`` bytes at ``offset`` of ``file`` came in with CRC-32 ``crc``."""
        self.pieces.append((file, offset, length, crc))

    def drop(self, files: Iterable[int]) -> None:
        """Forget the pieces of ``files`` (a local file read again: its first read does not count)."""
        gone = set(files)
        self.pieces = [p for p in self.pieces if p[0] not in gone]


def expected(sizes: Sequence[int], pieces: Iterable[tuple[int, int, int, int]]) -> tuple[dict[int, int], set[int]]:
    """Per file index, the CRC-32 of its bytes as they came from the source, where the pieces
    (file, offset, length, crc) of every rank tell it (:func:`compose`); and the files whose
    pieces disagree (two pieces of the same bytes with CRCs that do not fit: the bytes came
    from the source twice, differently)."""
    by_file: dict[int, list[tuple[int, int, int]]] = {}
    for file, offset, length, crc in pieces:
        by_file.setdefault(file, []).append((offset, length, crc))
    out: dict[int, int] = {}
    conflicting: set[int] = set()
    for file, found in by_file.items():
        if 0 <= file < len(sizes):
            composed, clash = _walk(sizes[file], found)
            if clash or (len(found) > 1 and _twice(found)):
                conflicting.add(file)
            elif composed is not None:
                out[file] = composed
    return out, conflicting


__all__ = ["SourcePieces", "combine", "compose", "crc32", "disagree", "expected"]
