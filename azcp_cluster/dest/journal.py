"""The block journal in DEST: which ranges of the temporary files are durably on disk.

Every rank that writes into a node's temporary files (its downloaders, or its leader's
fan-out writers) owns one journal file in ``DEST/.azcp-journal/``, appended to by a
background thread: at least every :data:`INTERVAL` seconds, and sooner once 16 MiB were
written (``resume.turn_due``), it takes the ranges written since the last time, makes those
files durable (``fdatasync``, or one ``syncfs`` for many files), and only then appends the
ranges, each with the CRC-32 of its bytes as they arrived, and syncs the journal. So a
recorded range is on disk; a torn append or a garbled journal can only claim less (resume.py).

A stopped run leaves the journals; the next run reads them (:func:`load`), keeps the
temporary files whose identity, size and version still match, reads every claimed range
back and keeps only those whose bytes still have the recorded CRC, and rewrites the journal
directory (:func:`begin`) before it writes anything. A run that finishes, or whose
``--verify`` fails, removes it. The crash-safety argument is in docs/reliability.md.

The directory and its files must be this user's own, not writable by others, and
reached without links (desttree.py): anything else is ignored, with one warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from azcp_cluster.core import resume
from azcp_cluster.core.errors import AzcpError, LocalFSError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.naming import JOURNAL_DIR
from azcp_cluster.dest import rehash
from azcp_cluster.dest.destroot import identity
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.localfs import fs_error, temp_name
from azcp_cluster.run.console import say
from azcp_cluster.run.interrupts import shield

# Seconds between two appends of a running journal at most: what a SIGKILL can lose. Sooner
# once enough was written: resume.turn_due.
INTERVAL = resume.TURN_MAX
# A journal larger than this is not read (a million small files journal some 60 MB).
READ_LIMIT = 1 << 30
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def tag(entry: FileEntry, origin: str) -> str:
    """The version a journal ties a file's ranges to: its ETag (a local file's stands in for
    its size, times and inode), where it came from, and its name there. No tag, no resume:
    nor for a weak ETag (``W/``: a local file whose identity cannot be believed,
    localsource.py), since blocks of another version could pass for it."""
    if not entry.etag or entry.etag.startswith("W/"):
        return ""
    return f"{entry.etag}|{origin}|{entry.name}"


@dataclass(frozen=True)
class Kept:
    """What a node keeps of a file from a stopped run."""

    identity: int  # of its temporary file, checked again at every open
    generation: int  # of its inode (resume.Header.generation)
    spans: tuple[tuple[int, int], ...]  # disjoint, sorted, aligned (resume.trim)
    claims: tuple[resume.Claim, ...] = ()  # the recorded ranges whose bytes were read back and matched

    @property
    def bytes(self) -> int:
        """Bytes kept."""
        return resume.total(self.spans)


def _own(st: os.stat_result, kind: Callable[[int], bool]) -> bool:
    """Whether a journal (directory or file) is this user's own and nobody else may write it."""
    return kind(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _warn(tree: DestTree, what: str) -> None:
    say(f"azcp-cluster: warning: {what} ({tree.shown(JOURNAL_DIR)}); the files it covers are copied whole")


def _read_all(tree: DestTree) -> list[list[resume.Record]]:
    """The records of every journal in DEST (none when there is no journal directory)."""
    try:
        st = os.stat(JOURNAL_DIR, dir_fd=tree.fd, follow_symlinks=False)
    except FileNotFoundError:
        return []
    except OSError as exc:
        _warn(tree, f"cannot inspect the block journal: {exc.strerror}")
        return []
    if not _own(st, stat.S_ISDIR):
        _warn(tree, "the block journal is not a directory of this user's own that only it may write; ignored")
        return []
    journals: list[list[resume.Record]] = []
    unreadable = older = 0
    try:
        with tree.directory([JOURNAL_DIR]) as dfd:
            for name in sorted(os.listdir(dfd)):
                data = _read_one(dfd, name)
                if data is None:
                    unreadable += 1
                    continue
                records, readable = resume.decode(data)
                if not readable and data.startswith(resume.MAGIC[:-1]):
                    older += 1  # another version's: never believed
                elif not readable:
                    unreadable += 1
                journals.append(records)
    except OSError as exc:
        _warn(tree, f"cannot read the block journal: {exc.strerror}")
        return []
    if unreadable:
        _warn(tree, f"{unreadable} file(s) of the block journal cannot be read (garbled, or not the tool's own)")
    if older:
        _warn(tree, f"{older} file(s) of the block journal come from another version of the tool; not resumed from")
    return journals


def _read_one(dfd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _own(st, stat.S_ISREG) or st.st_nlink != 1 or st.st_size > READ_LIMIT:
            return None
        chunks = []
        left = st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


# ioctl FS_IOC_GETVERSION (_IOR('v', 1, long)): an inode's generation (ext4, XFS, btrfs).
_GETVERSION = 0x80087601


def generation(fd: int) -> int:
    """The generation of ``fd``'s inode, or 0 where the filesystem keeps none (tmpfs)."""
    try:
        answer = fcntl.ioctl(fd, _GETVERSION, bytes(8))
    except OSError:
        return 0
    return int.from_bytes(answer[:4], "little")


def _generation_of(tree: DestTree, rel: str, ident: int) -> int | None:
    """The generation of the temporary file of ``rel`` if it is still the file ``ident``, else None."""
    try:
        fd = rehash.temp_opener(tree, rel)(os.O_RDONLY)
    except (OSError, LocalFSError):
        return None
    try:
        return generation(fd) if identity(os.fstat(fd)) == ident else None
    finally:
        os.close(fd)


def load(
    tree: DestTree, files: Sequence[FileEntry], candidates: Sequence[int], origin: str, received: bool = True
) -> dict[int, Kept]:
    """Leaders: what this node keeps of each of ``candidates`` (files it lacks), by the journals.

    A file counts only if its temporary file stands there now as a regular file of this
    user's, with one link, at the listed size, and is the file the journal names (inode
    and generation); a range only if its bytes, read back now, still have the CRC-32 it
    was recorded with (rehash.py). ``received``: keep ranges another node sent too (their
    CRC is of the bytes as they arrived here, which no source vouched for: ``--verify``
    keeps only those that came from the source itself, downloaded or read on this node,
    and the others are sent again from a node that has them so, or downloaded again).
    """
    journals = _read_all(tree)
    named = {r.path for records in journals for r in records if isinstance(r, resume.Header)}
    candidates = [i for i in candidates if files[i].path in named]  # the only ones worth a look
    if not candidates:
        return {}
    expected = _expected(tree, [files[i] for i in candidates], origin)
    if not expected:
        return {}  # DEST cannot be looked at
    claimed = resume.claims(journals, expected)
    if not received:  # (--verify) only what came from the source itself, never another node's bytes
        claimed = {path: [c for c in found if c.source] for path, found in claimed.items()}
    todo = [i for i in candidates if claimed.get(files[i].path)]
    jobs = [(files[i].path, expected[files[i].path].identity, claimed[files[i].path]) for i in todo]
    kept = {}
    for i, good in zip(todo, rehash.check_all(tree, jobs), strict=True):
        spans = resume.spans_of(good, files[i].size)
        if spans:
            want = expected[files[i].path]
            kept[i] = Kept(want.identity, want.generation, tuple(spans), tuple(good))
    return kept


def _expected(tree: DestTree, entries: Sequence[FileEntry], origin: str) -> dict[str, resume.Expected]:
    """What a journal must say of each of ``entries`` for its ranges to count: the size, the
    version (:func:`tag`) and its temporary file's identity and generation, both 0 unless that
    file may be resumed (:func:`_resumable`) and is still there. Empty if DEST cannot be looked at."""
    temps = []
    for entry in entries:
        head, _, base = entry.path.rpartition("/")
        temps.append(f"{head}/{temp_name(base)}" if head else temp_name(base))
    try:
        stats = tree.lstat_all(temps)
    except OSError:
        return {}  # cannot look: nothing is kept (the copy says what is wrong when it writes)
    expected: dict[str, resume.Expected] = {}
    for entry, st in zip(entries, stats, strict=True):
        ident = identity(st) if st is not None and _resumable(st, entry.size) else 0
        gen = _generation_of(tree, entry.path, ident) if ident else None
        if gen is None:
            ident = gen = 0  # gone, or replaced since the lstat: nothing of it is kept
        expected[entry.path] = resume.Expected(entry.size, tag(entry, origin), ident, gen)
    return expected


def _resumable(st: os.stat_result, size: int) -> bool:
    """Whether a temporary file may hold a stopped run's bytes: a regular file of this user's
    with one link (no other name may change it), at the listed ``size``."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid() and st.st_size == size


def _dir(tree: DestTree, create: bool) -> int:
    """The journal directory's descriptor (made if ``create``); refused unless it is ours."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(JOURNAL_DIR, 0o700, dir_fd=tree.fd)
    fd = os.open(JOURNAL_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tree.fd)
    if not _own(os.fstat(fd), stat.S_ISDIR):
        os.close(fd)
        raise PermissionError(errno.EPERM, "the block journal directory is not this user's own")
    return fd


def _create(dfd: int, name: str, data: bytes) -> int:
    """A journal file made anew (whatever stood at its name is removed), holding ``data``, synced."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dfd)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _FILE_FLAGS, 0o600, dir_fd=dfd)
    try:
        _write_all(fd, data)
        os.fdatasync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def begin(tree: DestTree, files: Sequence[FileEntry], kept: Mapping[int, Kept], origin: str) -> int | None:
    """Leaders, before any temporary file is made anew: the journal directory rewritten.

    It then holds one journal (this leader's, which it goes on appending to: its descriptor
    is returned) with what this run keeps, and nothing else: ranges of files made anew
    must not outlive the files they were written into. None when the directory cannot be
    used (not ours): the run then journals nothing (one warning).
    """
    records: list[resume.Record] = []
    for ident, (i, keep) in enumerate(sorted(kept.items())):
        entry = files[i]
        records.append(
            resume.Header(ident, entry.path, entry.size, tag(entry, origin), keep.identity, generation=keep.generation)
        )
        # The checked claims as they were recorded (their CRCs hold for those bytes), not the
        # trimmed spans: a claim's edges cut off by the trim are written again with the same bytes.
        records.extend(resume.Range(ident, c.offset, c.length, c.crc, c.source) for c in keep.claims)
    try:
        dfd = _dir(tree, create=True)
    except OSError:
        _clear(tree)  # not ours, or not a directory: its contents were not believed; made anew
        try:
            dfd = _dir(tree, create=True)
        except OSError as exc:
            _warn(tree, f"cannot use the block journal: {exc.strerror}; this run does not journal")
            return None
    try:
        fd = _create(dfd, ".rank-0.new", resume.MAGIC + resume.encode(records))
        try:
            os.rename(".rank-0.new", "rank-0", src_dir_fd=dfd, dst_dir_fd=dfd)
            for name in os.listdir(dfd):
                if name != "rank-0":
                    with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                        os.unlink(name, dir_fd=dfd)
            os.fsync(dfd)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dfd)
    return fd


def _clear(tree: DestTree) -> None:
    """Remove what stands at the journal's name (a link, a file, a directory others may
    write, and the names in it), never following a link."""
    with contextlib.suppress(OSError):
        st = os.stat(JOURNAL_DIR, dir_fd=tree.fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(JOURNAL_DIR, dir_fd=tree.fd)
            return
        dfd = os.open(JOURNAL_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tree.fd)
        try:
            for name in os.listdir(dfd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        os.rmdir(JOURNAL_DIR, dir_fd=tree.fd)


def open_for(tree: DestTree, index: int) -> int | None:
    """A node's other writing rank (``index`` in its node): its own journal, made anew."""
    try:
        dfd = _dir(tree, create=False)
    except OSError:
        return None  # the leader could not make one: nothing is journalled
    try:
        return _create(dfd, f"rank-{index}", resume.MAGIC)
    except OSError:
        return None
    finally:
        os.close(dfd)


def remove(tree: DestTree) -> None:
    """Leaders, once every file is under its final name (or failed to verify): no journal left
    (whoever's it is: nothing in it is believed), and the removal durable."""
    _clear(tree)
    with contextlib.suppress(OSError):
        os.fsync(tree.fd)  # the removals are durable before any file is made anew


class Journal:
    """One rank's running journal: :meth:`written` from any thread; appended at least every
    ``interval`` seconds, and sooner once ``early`` bytes were written (``resume.turn_due``;
    None: only by time)."""

    def __init__(
        self,
        tree: DestTree,
        fd: int,
        files: Sequence[FileEntry],
        origin: str,
        *,
        first_id: int = 0,
        interval: float = INTERVAL,
        early: int | None = resume.TURN_BYTES,
    ) -> None:
        self.tree = tree
        self.fd = fd
        self.files = files
        self.origin = origin
        self.interval = interval
        self.early = early
        self._least = min(resume.TURN_MIN, interval)
        self._pending_bytes = 0  # written since the last turn took the pending ranges
        self._ids: dict[int, int] = {}  # file index -> its header's id in this journal
        self._next_id = first_id
        self._pending: list[tuple[int, int, int, int, bool]] = []
        self._lock = threading.Lock()  # the pending list
        self._append = threading.Lock()  # one append at a time (the thread, drop, close)
        self._broken = False  # an append failed: nothing more is claimed
        # A sync that failed: the copy fails with it (close raises it). The kernel reports a
        # write-back error to the first sync that looks, so the sync stage may not see it again.
        self.error: AzcpError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="azcp-journal", daemon=True)
        self._thread.start()

    def written(self, file: int, offset: int, length: int, crc: int, source: bool = True) -> None:
        """``length`` bytes at ``offset`` of file ``file``, of CRC-32 ``crc`` as they arrived,
        were written (not yet durable); ``source``: they came from the source itself (a
        download, a local SOURCE's read), not from another node."""
        if length > 0:
            with self._lock:
                self._pending.append((file, offset, length, crc, source))
                self._pending_bytes += length

    def _loop(self) -> None:
        shield()
        last = time.monotonic()
        while True:
            since = time.monotonic() - last
            # Looked at every TURN_MIN (a turn by bytes is due from then on), or at the
            # interval's end, whichever comes first.
            wait = max(0.0, self.interval - since) if self.early is None else min(self._least, self.interval - since)
            if self._stop.wait(max(0.0, wait)):
                return
            now = time.monotonic()
            with self._lock:
                written = self._pending_bytes
            if resume.turn_due(written, now - last, self.interval, self._least, self.early):
                last = now
                self.flush()

    def flush(self) -> None:
        """Make what was written durable, then record it (a failure only stops the journal)."""
        with self._append:
            with self._lock:
                batch, self._pending = self._pending, []
                self._pending_bytes = 0
            if not batch or self._broken:
                return
            try:
                self._record(batch)
            except AzcpError as exc:  # the files' sync (fs_error): a write-back error of the copy's own
                self._broken = True
                self.error = self.error or exc
            except OSError as exc:  # the journal's own append
                self._broken = True
                self.error = self.error or fs_error(exc, self.tree.shown(JOURNAL_DIR), "write the block journal")

    def _record(self, batch: list[tuple[int, int, int, int, bool]]) -> None:
        files = self.files
        made = self.tree.made
        rels = sorted({files[f].path for f, *_ in batch if files[f].path in made})
        if not rels:
            return
        self.tree.sync_all(rels)  # durable first: only then claimed
        records: list[resume.Record] = []
        for f, offset, length, crc, source in batch:
            entry = files[f]
            ident = made.get(entry.path)
            if ident is None:
                continue  # renamed or never ours: not claimed
            key = self._ids.get(f)
            if key is None:
                gen = self._generation(entry.path)
                if gen is None:
                    continue  # not the file this run made any more: not claimed
                key = self._ids[f] = self._next_id
                self._next_id += 1
                records.append(
                    resume.Header(key, entry.path, entry.size, tag(entry, self.origin), ident, generation=gen)
                )
            records.append(resume.Range(key, offset, length, crc, source))
        _write_all(self.fd, resume.encode(records))
        os.fdatasync(self.fd)

    def _generation(self, rel: str) -> int | None:
        try:
            fd = self.tree.opener(rel, temp=True)(os.O_RDONLY)  # only the file this run made
        except (OSError, LocalFSError):
            return None
        try:
            return generation(fd)
        finally:
            os.close(fd)

    def drop(self, paths: Sequence[str]) -> None:
        """``paths`` are made anew: none of their ranges counts any more (durably, before they are)."""
        self.flush()
        with self._append:
            if self.error is not None:
                raise self.error
            try:
                _write_all(self.fd, resume.encode(resume.Drop(p) for p in paths))
                os.fdatasync(self.fd)
            except OSError as exc:
                raise fs_error(exc, self.tree.shown(JOURNAL_DIR), "write the block journal") from None
            # A later header for one of them is for the new file (and the drop still applies:
            # such ranges are under-claimed, never over-claimed).
            self._ids = {f: k for f, k in self._ids.items() if self.files[f].path not in set(paths)}

    def close(self) -> None:
        """Stop the thread and record what was written since the last append; raise the error
        of a sync that failed (a LocalFSError: the copy's bytes may not be on the disk)."""
        self._stop.set()
        self._thread.join()
        self.flush()
        with self._append:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        if self.error is not None:
            raise self.error
