"""DEST as a directory handle: every name below it is reached one component at a time, never through a link.

The tool runs as root on nodes that other jobs share, and anyone who may write into DEST
(or a directory below it) can put a symbolic link, a hard link, a FIFO or a directory where
the tool is about to write, at any moment of the run. So no path below DEST is ever handed
to the kernel whole:

* DEST's real path is opened once (:class:`DestTree`); every directory below it is opened
  relative to its parent with ``O_NOFOLLOW | O_DIRECTORY``, so a symlinked directory is
  refused (exit 8, naming it), never written through, wherever it points;
* a temporary name is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` after whatever stood
  there (a leftover of a crashed run, a link, a FIFO) is unlinked: the file written is one
  this run made;
* every later open of a file for writing or reading (the downloaders, the broadcast's
  writers and owner, fsync, verify) is ``O_NOFOLLOW | O_NONBLOCK`` relative to its
  directory, and the file must be a regular file with one link: a FIFO cannot hang the job
  and a hard link to a file elsewhere is never written into;
* renames are ``renameat`` within one directory descriptor, checked afterwards.

What this does not defend against is stated in docs/reliability.md (a root attacker, and
someone who moves a directory of the run's own files away while it runs).

Looking at DEST without writing (the root descriptor, directories, lstat in batches, the
regular-file checks) is destroot.py's, which :class:`DestTree` extends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from azcp_cluster.core.errors import LocalFSError
from azcp_cluster.dest.destroot import FILE_FLAGS, DestRoot, NotAFileError, checked, identity, split
from azcp_cluster.dest.directio import Opener
from azcp_cluster.dest.localfs import fs_error, preallocate, syncfs, temp_name
from azcp_cluster.run.interrupts import shield
from azcp_cluster.run.report import write_synced

# Tries at creating a temporary name that someone keeps putting something at.
_CREATE_TRIES = 3
# From this many files (or directories) on, one syncfs makes them durable instead of one
# fsync each.
BULK_SYNC = 16
# Files at least this large get their blocks reserved when their temporary name is made
# (localfs.preallocate: it matters for O_DIRECT writes into one large file); a smaller file
# is written whole, buffered, by one writer, and a fallocate each costs more than the
# ftruncate that gives it its size (docs/benchmarks.md). The space check covers both.
PREALLOCATE_MIN = 1 << 20


class DestTree(DestRoot):
    """DEST, opened by its real path; the files and directories below it, reached without links.

    ``path`` is DEST as the user gave it (expanded), used in messages. Thread-safe: every
    method works on descriptors of its own, relative to the one root descriptor. Looking
    (directories, lstat in batches) is :class:`~azcp_cluster.dest.destroot.DestRoot`'s; this
    class makes, opens, syncs and renames the run's own temporary files.
    """

    def __init__(self, path: str, create: bool = False) -> None:
        # The temporary files this run made (relative path -> identity): only these are ever
        # written into, read back, synced or renamed. A node's other ranks adopt the leader's.
        self.made: dict[str, int] = {}
        super().__init__(path, create)

    def space_needed(self, files: Iterable[tuple[str, int]]) -> int:
        """Bytes that writing ``files`` (relative path, size) will take from DEST's free space.

        A temporary file left by an interrupted run is replaced: the blocks it holds come back
        first, so they do not count against the run.
        """
        wanted = list(files)
        temps = []
        for rel, _ in wanted:
            parts, base = split(rel)
            temps.append("/".join([*parts, temp_name(base)]))
        try:
            stats = self.lstat_all(temps)
        except OSError:
            stats = [None] * len(temps)  # cannot say: the files' own creation will tell
        held = [_blocks_of_our_own(st) for st in stats]
        return sum(max(0, size - h) for (_, size), h in zip(wanted, held, strict=True))

    # -- opening files --------------------------------------------------------------------

    def opener(self, rel: str, temp: bool, dfd: int | None = None) -> Opener:
        """For :mod:`directio`: opens ``rel``'s temporary (``temp``) or final name with the flags given.

        Each call walks from DEST's descriptor again: a directory swapped for a link since the
        last open is refused, not followed. ``dfd``: the descriptor of ``rel``'s directory,
        walked just before by the caller for a batch of files in it (:meth:`directory`), so
        a batch of small files costs one walk, not one each.
        """
        parts, base = split(rel)
        name = temp_name(base) if temp else base

        def open_with(flags: int) -> int:
            try:
                if dfd is None:
                    fd = self._open_file(parts, name, flags)
                else:
                    fd = checked(os.open(name, flags | FILE_FLAGS, dir_fd=dfd))
            except NotAFileError as exc:
                raise LocalFSError(exc.strerror or str(exc), path=self.shown("/".join([*parts, name]))) from None
            except OSError as exc:
                # ELOOP: a symlink (O_NOFOLLOW); ENXIO: a FIFO or socket (O_NONBLOCK, no reader).
                if exc.errno in (errno.ELOOP, errno.ENXIO):
                    what = "a symbolic link" if exc.errno == errno.ELOOP else "not a regular file"
                    raise LocalFSError(
                        f"is {what}; the copy writes and reads only files it made itself",
                        path=self.shown("/".join([*parts, name])),
                    ) from None
                raise
            if temp and not self._ours(rel, fd):
                os.close(fd)
                raise LocalFSError(
                    "is not the temporary file this run made (something replaced it); refusing to use it",
                    path=self.shown("/".join([*parts, name])),
                )
            return fd

        return open_with

    def _ours(self, rel: str, fd: int) -> bool:
        return self.made.get(rel) == identity(os.fstat(fd))

    def adopt(self, made: dict[str, int]) -> None:
        """Take over the identities of the temporary files another rank of this node made."""
        self.made.update(made)

    def temp_shown(self, rel: str) -> str:
        """DEST/dir/.name.azcp-part, for messages."""
        parts, base = split(rel)
        return self.shown("/".join([*parts, temp_name(base)]))

    # -- making files -----------------------------------------------------------------------

    def prepare_all(self, files: Iterable[tuple[str, int]], later: Iterable[str] = ()) -> None:
        """Create every file's temporary name at its full size (blocks reserved where possible).

        Grouped by directory, so each directory is walked (and made) once. The files named in
        ``later`` get their directory and a cleared temporary name only: the broadcast's
        writer creates each when its bytes arrive (:meth:`create_at`), one open per small
        file instead of two. Only for files no other rank writes into.
        """
        deferred = set(later)
        by_dir: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
        for rel, size in files:
            parts, base = split(rel)
            by_dir[tuple(parts)].append((base, size))
        for folder, entries in by_dir.items():
            where = self.shown("/".join(folder))
            try:
                with self.directory(list(folder), create=True) as dfd:
                    for base, size in entries:
                        rel = "/".join([*folder, base])
                        if rel in deferred:
                            self._clear(dfd, temp_name(base), self.temp_shown(rel))
                            self.made.pop(rel, None)  # an earlier round's file is not this one
                        else:
                            os.close(self._create_temp(dfd, rel, base, size))
            except OSError as exc:
                raise fs_error(exc, where, "create directory") from None

    def prepare(self, rel: str, size: int) -> None:
        """Create (anew) the temporary file of ``rel`` at ``size`` bytes."""
        self.prepare_all([(rel, size)])

    def create_at(self, dfd: int, rel: str) -> int:
        """Create the temporary file of ``rel`` (deferred by :meth:`prepare_all`) in its directory
        ``dfd``, for writing; returns the descriptor. Anything put at the name since is cleared
        again, never followed or written into."""
        return self._create_temp(dfd, rel, split(rel)[1], 0)

    def _create_temp(self, dfd: int, rel: str, base: str, size: int) -> int:
        name = temp_name(base)
        shown = self.temp_shown(rel)
        for _ in range(_CREATE_TRIES):
            self._clear(dfd, name, shown)
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, 0o644, dir_fd=dfd)
            except FileExistsError:
                continue  # someone put something there again since: clear it again
            except OSError as exc:
                raise fs_error(exc, shown, "create temporary file") from None
            try:
                self.made[rel] = identity(os.fstat(fd))
                if size >= PREALLOCATE_MIN:
                    preallocate(fd, size)
                elif size:
                    os.ftruncate(fd, size)  # at full size, as a preallocated one: only no blocks reserved
            except OSError as exc:
                os.close(fd)
                raise fs_error(exc, shown, "create temporary file") from None
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise LocalFSError("something keeps being put at this temporary name while the copy makes it", path=shown)

    def _clear(self, dfd: int, name: str, shown: str) -> None:
        """Remove what stands at a temporary name: a leftover, a link, a FIFO. A directory is refused."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise fs_error(exc, shown, "inspect temporary file") from None
        if stat.S_ISDIR(st.st_mode):
            raise LocalFSError("a directory stands where the copy makes a temporary file; remove it", path=shown)
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise fs_error(exc, shown, "replace a leftover temporary file") from None

    # -- finishing --------------------------------------------------------------------------

    def sync(self, rel: str) -> None:
        """Make the temporary file of ``rel`` durable (``fdatasync``: its size was set when it
        was made, and the data is what has to reach the disk)."""
        try:
            fd = self.opener(rel, temp=True)(os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise fs_error(exc, self.temp_shown(rel), "sync file") from None

    def sync_all(self, rels: list[str]) -> None:
        """Make the temporary files of ``rels`` durable, before any of them is renamed.

        From :data:`BULK_SYNC` files on, one ``syncfs`` of DEST's filesystem does it (an
        fsync each cost 20,000 small files 3.2 s here); else, or where syncfs cannot be
        trusted, an ``fdatasync`` each, 8 at a time (each waits on the disk, not the CPU).
        """
        root = os.fstat(self.fd).st_dev
        # A directory below DEST may be another filesystem's mount point: its files are
        # synced one by one (syncfs covers DEST's own filesystem only).
        elsewhere = [rel for rel in rels if self.made.get(rel, 0) >> 96 != root]
        if len(rels) - len(elsewhere) >= BULK_SYNC and self._syncfs():
            rels = elsewhere
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="azcp-sync", initializer=shield) as pool:
            list(pool.map(self.sync, rels))

    def _syncfs(self) -> bool:
        try:
            return syncfs(self.fd)
        except OSError as exc:
            raise fs_error(exc, self.path, "sync DEST's filesystem") from None

    def rename(self, rel: str) -> None:
        """Rename ``rel``'s temporary name to its final name (replacing what stood there), then
        check that the final name is the file that was renamed."""
        self.rename_all([rel])

    def rename_all(self, rels: Iterable[str], threads: int = 8) -> None:
        """:meth:`rename` every name, each directory walked once; directories on ``threads`` threads."""
        by_dir: dict[tuple[str, ...], list[tuple[str, str]]] = defaultdict(list)
        for rel in rels:
            parts, base = split(rel)
            by_dir[tuple(parts)].append((rel, base))

        def rename_in(folder: tuple[str, ...]) -> None:
            entries = by_dir[folder]
            try:
                with self.directory(list(folder)) as dfd:
                    for rel, base in entries:
                        self._rename_at(dfd, rel, base)
            except OSError as exc:
                raise fs_error(exc, self.shown("/".join(folder)), "finish files") from None

        if len(by_dir) == 1 or threads == 1:
            for folder in by_dir:
                rename_in(folder)
            return
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="azcp-fin", initializer=shield) as pool:
            list(pool.map(rename_in, list(by_dir)))

    def _rename_at(self, dfd: int, rel: str, base: str) -> None:
        name = temp_name(base)
        made = self.made.get(rel)
        try:
            # Nothing to open: the name must still be the file this run made, before the
            # rename and (someone may swap it in between) under the final name after it.
            if identity(os.stat(name, dir_fd=dfd, follow_symlinks=False)) != made:
                raise LocalFSError(
                    "is not the temporary file this run made (something replaced it); refusing to rename it",
                    path=self.temp_shown(rel),
                )
            os.rename(name, base, src_dir_fd=dfd, dst_dir_fd=dfd)
            now = identity(os.stat(base, dir_fd=dfd, follow_symlinks=False))
        except OSError as exc:
            raise fs_error(exc, self.shown(rel), "finish file") from None
        if now != made:
            raise LocalFSError("was replaced by something else while the copy renamed it", path=self.shown(rel))
        self.made.pop(rel, None)

    def finalize(self, rel: str) -> None:
        """fsync the temporary file of ``rel`` and rename it to its final name."""
        self.sync(rel)
        self.rename(rel)

    def sync_dirs(self, rels: Iterable[str]) -> None:
        """fsync the directories holding ``rels`` (so the renames in them survive a crash);
        one ``syncfs`` for many directories."""
        folders = sorted({tuple(split(rel)[0]) for rel in rels})
        # With one syncfs, only a directory on another filesystem (a mount point below DEST)
        # still needs its own fsync.
        synced = os.fstat(self.fd).st_dev if len(folders) >= BULK_SYNC and self._syncfs() else None
        for parts in folders:
            where = self.shown("/".join(parts))
            try:
                with self.directory(list(parts)) as fd:
                    if os.fstat(fd).st_dev != synced:
                        os.fsync(fd)
            except OSError as exc:
                raise fs_error(exc, where, "sync directory") from None

    # -- small files of the tool's own at DEST's top ----------------------------------------

    def read_small(self, name: str, limit: int) -> bytes | None:
        """The content of DEST/``name`` (a regular file, at most ``limit`` bytes), or None."""
        try:
            fd = self._open_file([], name, os.O_RDONLY)
        except (OSError, LocalFSError):
            return None
        try:
            data = os.pread(fd, limit + 1, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data if len(data) <= limit else None

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace DEST/``name`` with ``data``: a temporary name made anew, fsync, rename."""
        shown = self.shown(name)
        tmp = temp_name(name)
        try:
            self._clear(self.fd, tmp, shown)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, 0o644, dir_fd=self.fd)
            try:
                write_synced(fd, data)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            os.fsync(self.fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise fs_error(exc, shown, "write") from None


def _blocks_of_our_own(st: os.stat_result | None) -> int:
    """Disk bytes a leftover temporary file gives back when it is replaced (0 for a link, a FIFO, a hard link)."""
    return st.st_blocks * 512 if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


def source_opener(path: str) -> Opener:
    """For a local SOURCE's files: opens ``path`` without blocking on a FIFO; refuses anything but a regular file."""

    def open_with(flags: int) -> int:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotAFileError(errno.EPERM, "is not a regular file any more")
        return fd

    return open_with
