"""Resume by block: the journal's records, and the byte ranges each node still lacks. Pure code.

A run writes every file under a temporary name (desttree.py). While it runs, every rank that
writes into those files appends to a journal in DEST the byte ranges that are durably on
disk (journal.py does the I/O). A run that was stopped leaves the temporary files and the
journal behind; the next run reads the journal, keeps what it proves, and moves only the
rest. This module owns the arithmetic and the wire form:

* **Records.** A journal is a magic string followed by records, each framed as
  ``length (u32) | crc32 (u32) | payload``. A payload is a header (``H``: a file's path,
  listed size, version tag and the identity of the temporary file the ranges are in), a
  range (``R``: a header's id, an offset, a length, the CRC-32 of the bytes written there,
  taken from the bytes as they arrived, and whether they came from the source itself, a
  downloaded block or a local SOURCE's read, or from another node over the fabric) or a drop
  (``X``: a path whose ranges, in every journal, no longer count). A torn or corrupt record ends the reading: what comes
  after it is not believed (a journal can only under-claim).
* **Claims.** A recorded range is only a claim: the next run reads its bytes back and keeps it
  only if their CRC-32 is still the recorded one (journal.load), so a block that a disk, a
  filesystem or another writer changed after it was written is fetched again, never trusted
  and sent on to the other nodes.
* **Ranges.** What a node holds of a file is the union of its checked ranges, trimmed
  inward to :data:`RESUME_ALIGN` (but for the file's end): the missing ranges then start on
  aligned offsets, as the plan's shards do, so O_DIRECT still applies to them.
* **Segments.** Over all nodes, a file cuts into segments with one set of holders each:
  nobody (downloaded again), some (sent by a peer to those that lack it) or all (nothing
  moves).
* **Turns.** When a running journal makes what was written durable and appends it
  (:func:`turn_due`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import NamedTuple

# Version 5: each range carries the CRC-32 of its bytes and whether they came from the source
# on that node. Version 4 ranges carried a CRC-32C: every kept block would fail its check, so
# they claim nothing. Version 3 ranges (builds during issue 38's work) had the CRC alone,
# version 2 none (nothing to check a kept range against), and version 1 journals were written
# by builds whose fan-out receivers could record a failed root's unfilled slot (zeros) as
# kept; all claim nothing (journal.py warns once: another version of the tool).
MAGIC = b"AZCPJNL5"
# Held ranges start and end on multiples of this (but for a file's end): the alignment of
# the plan's shard boundaries (plan.SHARD_ALIGN), so a missing range is a shard's range.
RESUME_ALIGN = 4096
# Part of every header: a journal made with another alignment claims nothing.
GEOMETRY = RESUME_ALIGN

_FRAME = struct.Struct("<II")  # payload length, crc32 of the payload
_HEADER = struct.Struct("<cIQQQQII")  # 'H', id, size, dev, uid, ino, geometry, generation; then tag, path
_RANGE = struct.Struct("<cIQQI?")  # 'R', id, offset, length, CRC-32, from the source
_LIMIT = 1 << 20  # no record is larger: a length above it is garbage


class Header(NamedTuple):
    """What a journal's ranges of one file are tied to."""

    id: int  # within its journal
    path: str  # below DEST
    size: int  # as listed
    tag: str  # the listed version: the blob's ETag, a local file's size and mtime
    identity: int  # the temporary file's (device, owner, inode): destroot.identity
    geometry: int = GEOMETRY
    # The inode's generation (FS_IOC_GETVERSION; 0 where the filesystem has none): a file made
    # in a removed one's place may get its inode number, by the same owner, never its generation.
    generation: int = 0


class Range(NamedTuple):
    """``length`` bytes at ``offset`` of the file of header ``id`` are durable, and their
    CRC-32 (as they arrived) is ``crc``; ``source``: they came from the source itself (a
    downloaded block, a local SOURCE's read), not from another node over the fabric."""

    id: int
    offset: int
    length: int
    crc: int
    source: bool = True


class Drop(NamedTuple):
    """The ranges of ``path`` count no more (its temporary file was made anew)."""

    path: str


Record = Header | Range | Drop


# A running journal's turns (journal.Journal): at least every TURN_MAX seconds (what a SIGKILL
# can lose), and sooner, from TURN_MIN seconds on, once TURN_BYTES were written since the
# last one. A turn's syncs wait for what was written since the one before, and the writers
# wait with them, so a fast copy turns by bytes and a slow one by the clock
# (docs/benchmarks.md has the timings; docs/reliability.md what a turn guarantees).
TURN_MAX = 1.0  # a SIGKILL loses at most a second of recorded writes
TURN_MIN = 0.25  # no sooner: the syncs of a turn stall the writers
TURN_BYTES = 16 << 20  # a fast copy's turn: a few slots' worth


def turn_due(
    written: int, since: float, most: float = TURN_MAX, least: float = TURN_MIN, early: int | None = TURN_BYTES
) -> bool:
    """Whether a running journal's next turn is due, ``since`` seconds after its last one with
    ``written`` bytes recorded since: after ``most`` seconds, or, after ``least``, once
    ``written`` reached ``early`` (None: only by time)."""
    if since >= most:
        return True
    return early is not None and since >= least and written >= early


def encode(records: Iterable[Record]) -> bytes:
    """The records, framed (append them to a journal that starts with :data:`MAGIC`)."""
    parts: list[bytes] = []
    for record in records:
        if isinstance(record, Range):
            payload = _RANGE.pack(b"R", record.id, record.offset, record.length, record.crc, record.source)
        elif isinstance(record, Header):
            identity = record.identity
            fixed = _HEADER.pack(
                b"H",
                record.id,
                record.size,
                identity >> 96,
                (identity >> 64) & 0xFFFFFFFF,
                identity & ((1 << 64) - 1),
                record.geometry,
                record.generation,
            )
            tag = record.tag.encode("utf-8")
            payload = fixed + struct.pack("<H", len(tag)) + tag + record.path.encode("utf-8")
        else:
            payload = b"X" + record.path.encode("utf-8")
        parts.append(_FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
    return b"".join(parts)


def decode(data: bytes) -> tuple[list[Record], bool]:
    """The records of a journal's bytes, up to the first torn or corrupt one.

    Returns (records, readable): ``readable`` is False when the bytes do not start as a
    journal (garbage, another file): then no record is believed.
    """
    if not data.startswith(MAGIC):
        return [], False
    records: list[Record] = []
    at = len(MAGIC)
    view = memoryview(data)
    while at + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, at)
        start = at + _FRAME.size
        if length == 0 or length > _LIMIT or start + length > len(data):
            break  # torn: written in part when the run stopped
        payload = bytes(view[start : start + length])
        if zlib.crc32(payload) != crc:
            break
        record = _parse(payload)
        if record is None:
            break
        records.append(record)
        at = start + length
    return records, True


def _parse(payload: bytes) -> Record | None:
    kind = payload[:1]
    try:
        if kind == b"R" and len(payload) == _RANGE.size:
            _, ident, offset, length, crc, source = _RANGE.unpack(payload)
            return Range(ident, offset, length, crc, source)
        if kind == b"H" and len(payload) >= _HEADER.size + 2:
            _, ident, size, dev, uid, ino, geometry, generation = _HEADER.unpack_from(payload)
            (tag_length,) = struct.unpack_from("<H", payload, _HEADER.size)
            tag_end = _HEADER.size + 2 + tag_length
            if tag_end > len(payload):
                return None
            tag = payload[_HEADER.size + 2 : tag_end].decode("utf-8")
            path = payload[tag_end:].decode("utf-8")
            return Header(ident, path, size, tag, (dev << 96) | (uid << 64) | ino, geometry, generation)
        if kind == b"X":
            return Drop(payload[1:].decode("utf-8"))
    except (struct.error, UnicodeDecodeError):
        return None
    return None


class Expected(NamedTuple):
    """What a file must be for a journal's ranges of it to count."""

    size: int
    tag: str
    identity: int  # of the temporary file standing there now (0: none fit to resume)
    generation: int = 0  # its inode's generation (Header.generation)


class Claim(NamedTuple):
    """A recorded range of one file: ``length`` bytes at ``offset`` whose CRC-32 was ``crc``;
    ``source``: as they came from the source (else as another node sent them: Range.source)."""

    offset: int
    length: int
    crc: int
    source: bool = True


def held(journals: Iterable[Sequence[Record]], expected: Mapping[str, Expected]) -> dict[str, list[tuple[int, int]]]:
    """Per path, the ranges the journals claim, merged and trimmed (see the module), their
    bytes not checked: :func:`claims`, then :func:`spans_of` what was checked."""
    return {
        path: kept
        for path, found in claims(journals, expected).items()
        if (kept := spans_of(found, expected[path].size))
    }


def spans_of(found: Iterable[Claim], size: int) -> list[tuple[int, int]]:
    """The disjoint, aligned spans a file's checked claims cover (merged, then trimmed)."""
    return trim(merge((c.offset, c.offset + c.length) for c in found), size)


def claims(journals: Iterable[Sequence[Record]], expected: Mapping[str, Expected]) -> dict[str, list[Claim]]:
    """Per path, the ranges the journals claim, as recorded (see the module).

    A range counts only under a header that matches the file as listed now (size, tag,
    geometry) and the temporary file standing there now (its identity). A path dropped in
    any journal counts nothing.
    """
    dropped: set[str] = set()
    found: dict[str, list[Claim]] = {}
    for records in journals:
        headers: dict[int, Header] = {}
        for record in records:
            if isinstance(record, Range):
                header = headers.get(record.id)
                if header is None:
                    continue
                end = record.offset + record.length
                if record.length > 0 and end <= header.size:
                    claim = Claim(record.offset, record.length, record.crc, record.source)
                    found.setdefault(header.path, []).append(claim)
            elif isinstance(record, Header):
                want = expected.get(record.path)
                fits = (
                    want is not None
                    and want.identity != 0
                    and want.tag != ""
                    and (record.size, record.tag, record.identity, record.generation, record.geometry)
                    == (want.size, want.tag, want.identity, want.generation, GEOMETRY)
                )
                if fits:
                    headers[record.id] = record
                else:
                    headers.pop(record.id, None)  # an id reused for a file that does not fit
            else:
                dropped.add(record.path)
    return {path: ranges for path, ranges in found.items() if path not in dropped}


def merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` spans as the fewest disjoint ones, sorted (touching spans join)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def trim(spans: Iterable[tuple[int, int]], size: int, align: int = RESUME_ALIGN) -> list[tuple[int, int]]:
    """Each span shrunk inward to multiples of ``align``; an end at ``size`` stays. Empty ones go."""
    out = []
    for start, end in spans:
        start = -(-start // align) * align
        if end != size:
            end = end // align * align
        if end > start:
            out.append((start, end))
    return out


def total(spans: Iterable[tuple[int, int]]) -> int:
    """Bytes in disjoint spans."""
    return sum(end - start for start, end in spans)


class Segment(NamedTuple):
    """``length`` bytes at ``offset`` of one file, held by exactly ``holders`` (ascending)."""

    offset: int
    length: int
    holders: tuple[int, ...]


def segments(size: int, holdings: Mapping[int, Sequence[tuple[int, int]]]) -> list[Segment]:
    """Cut ``[0, size)`` where the set of holders changes.

    ``holdings`` maps a holder (a leader's rank) to the disjoint spans it has (a whole copy:
    ``[(0, size)]``). Adjacent pieces with the same holders are one segment; every byte is in
    exactly one segment.
    """
    if size <= 0:
        return []
    cuts = {0, size}
    for spans in holdings.values():
        for start, end in spans:
            cuts.add(max(0, min(size, start)))
            cuts.add(max(0, min(size, end)))
    edges = sorted(cuts)
    out: list[Segment] = []
    for start, end in pairwise(edges):
        holders = tuple(sorted(h for h, spans in holdings.items() if _covers(spans, start, end)))
        if out and out[-1].holders == holders and out[-1].offset + out[-1].length == start:
            last = out[-1]
            out[-1] = Segment(last.offset, last.length + end - start, holders)
        else:
            out.append(Segment(start, end - start, holders))
    return out


def _covers(spans: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    # Spans are disjoint and the piece lies between two cuts: inside one span, or outside all.
    return any(s <= start and end <= e for s, e in spans)
