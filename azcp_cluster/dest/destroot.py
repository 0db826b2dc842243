"""DEST's root descriptor, and looking at what stands below it without following a link.

Apart from the run's own files (desttree.py: the temporary names made, opened, synced and
renamed) because this half only reads: directories reached component by component from
the one root descriptor (``O_NOFOLLOW | O_DIRECTORY``), names stat'ed a directory at a time
(on threads where the calls are slow), and the checks that make a descriptor a regular file
with one link. The lock (destlock.py) and the block journal use these too. Why no path
below DEST is ever handed to the kernel whole is desttree.py's docstring.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import defaultdict
from collections.abc import Iterable, Iterator

from azcp_cluster.core.errors import DiffError, LocalFSError
from azcp_cluster.dest.localfs import fs_error
from azcp_cluster.dest.syscalls import CallPool

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# No file the tool opens may block the open (a FIFO) or be followed (a link).
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Names stat'ed per batch of the compare (one directory's: one directory opened per batch).
STAT_BATCH = 1024


def split(rel: str) -> tuple[list[str], str]:
    """``"a/b/c"`` -> (``["a", "b"]``, ``"c"``)."""
    head, _, base = rel.rpartition("/")
    return (head.split("/") if head else []), base


class NotAFileError(OSError):
    """A name the tool must write or read is not a regular file with a single link."""


class DestRoot:
    """DEST, opened by its real path; what stands below it, reached without links (read only).

    ``path`` is DEST as the user gave it (expanded), used in messages. Thread-safe: every
    method works on descriptors of its own, relative to the one root descriptor.
    """

    def __init__(self, path: str, create: bool = False) -> None:
        self.path = path
        self.real = os.path.realpath(path)
        self.fd = -1
        try:
            # The real path's last component must itself be a directory, not a link put there
            # since realpath() looked.
            self.fd = os.open(self.real, DIR_FLAGS)
        except FileNotFoundError:
            if create:
                missing = FileNotFoundError(errno.ENOENT, "No such file or directory")
                raise fs_error(missing, path, "open DEST") from None
        except OSError as exc:
            raise fs_error(exc, path, "open DEST") from None

    @property
    def exists(self) -> bool:
        """Whether DEST existed when opened (a dry run's DEST may not)."""
        return self.fd >= 0

    @property
    def removed(self) -> bool:
        """Whether DEST was removed since it was opened (another run that made it removed it, empty)."""
        if self.fd < 0:
            return False
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return False

    def close(self) -> None:
        """Close the root descriptor."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def shown(self, rel: str) -> str:
        """``rel`` as a path below DEST, for messages."""
        return os.path.join(self.path, *rel.split("/")) if rel else self.path

    # -- directories ----------------------------------------------------------------------

    def _open_dir(self, parts: list[str], create: bool) -> int:
        """A descriptor of DEST/``parts`` (the caller closes it), reached component by component.

        A component that is a symlink, or anything but a directory, is refused with a
        :class:`LocalFSError` naming it. Missing components are made when ``create``; else
        FileNotFoundError.
        """
        if self.fd < 0:
            raise FileNotFoundError(errno.ENOENT, "DEST does not exist")
        fd = os.dup(self.fd)
        try:
            for depth, part in enumerate(parts):
                if create:
                    # Whatever stands there already (a directory, or a link: refused below) stays.
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    child = os.open(part, DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise self._not_a_directory(fd, parts, depth) from None
                    raise
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _not_a_directory(self, fd: int, parts: list[str], depth: int) -> LocalFSError:
        where = self.shown("/".join(parts[: depth + 1]))
        try:
            st = os.stat(parts[depth], dir_fd=fd, follow_symlinks=False)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            return LocalFSError(
                "is a symbolic link where the copy needs a directory; refusing to write through it "
                "(remove it, or make DEST a directory that holds no links)",
                path=where,
            )
        return LocalFSError("is not a directory, but the copy needs a directory there", path=where)

    @contextlib.contextmanager
    def directory(self, parts: list[str], create: bool = False) -> Iterator[int]:
        """The descriptor of DEST/``parts`` for the ``with`` block."""
        fd = self._open_dir(parts, create)
        try:
            yield fd
        finally:
            os.close(fd)

    # -- looking ----------------------------------------------------------------------------

    def lstat(self, rel: str) -> os.stat_result | None:
        """What stands at DEST/``rel`` itself (a link is not followed); None if nothing, or if a
        directory on the way is missing, a link or not a directory."""
        parts, base = split(rel)
        try:
            with self.directory(parts) as fd:
                return os.stat(base, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError, LocalFSError):
            return None

    def lstat_all(self, rels: Iterable[str]) -> list[os.stat_result | None]:
        """:meth:`lstat` of every name, each directory walked once per batch (a million files,
        a few directories: a few million system calls fewer), the batches on threads where the
        calls are slow (a shared filesystem: azcp_cluster/dest/syscalls.py). Errors other than "not
        there" raise ``OSError``, with ``filename`` set to the name looked at: that of the
        first failing batch, whatever the threads did."""
        names = list(rels)
        found: list[os.stat_result | None] = [None] * len(names)
        # Grouped by the directory's name, split into its components once per directory.
        by_dir: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for index, rel in enumerate(names):
            head, _, base = rel.rpartition("/")
            by_dir[head].append((index, base))
        batches = [
            (head.split("/") if head else [], entries[at : at + STAT_BATCH])
            for head, entries in by_dir.items()
            for at in range(0, len(entries), STAT_BATCH)
        ]

        def stat_batch(batch: tuple[list[str], list[tuple[int, str]]]) -> int:
            folder, entries = batch
            try:
                dfd = self._open_dir(folder, create=False)
            except (FileNotFoundError, NotADirectoryError, LocalFSError):
                return 1  # missing, a link or not a directory: nothing of ours below it
            try:
                for index, base in entries:
                    try:
                        found[index] = os.stat(base, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        exc.filename = names[index]
                        raise
            finally:
                os.close(dfd)
            return len(folder) + 1 + len(entries)  # the system calls made: the opens, the stats

        with CallPool() as calls:
            calls.map(stat_batch, batches, calls=int)
        return found

    def present_all(self, files: Iterable[tuple[str, int]]) -> list[bool]:
        """For each (path, size): whether it stands in DEST as a regular file of that size with one link.

        A link, a hard-linked file, a FIFO or a file below a symlinked directory is not a copy:
        it is copied again (and replaced by the rename). Absent is an answer; a file that
        cannot be looked at (permissions, I/O error) is a :class:`DiffError`.
        """
        wanted = list(files)
        try:
            stats = self.lstat_all(rel for rel, _ in wanted)
        except OSError as exc:
            where = self.shown(str(exc.filename)) if exc.filename else self.path
            raise DiffError(f"cannot inspect the local copy: {exc.strerror or exc}", path=where) from None
        return [
            st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size == size
            for st, (_, size) in zip(stats, wanted, strict=True)
        ]

    def is_present(self, rel: str, size: int) -> bool:
        """:meth:`present_all` of one file."""
        return self.present_all([(rel, size)])[0]

    def _open_file(self, parts: list[str], name: str, flags: int) -> int:
        with self.directory(parts) as dfd:
            fd = os.open(name, flags | FILE_FLAGS, dir_fd=dfd)
        return checked(fd)


def identity(st: os.stat_result) -> int:
    """One number for (device, owner, inode): which file a name or a descriptor is.

    The owner is part of it because a filesystem may give a removed file's inode number to
    the next file made (ext4 does at once): a file someone else put there in its place is
    theirs, not the run's.
    """
    return (st.st_dev << 96) | (st.st_uid << 64) | st.st_ino


def checked(fd: int, close: bool = True) -> int:
    """``fd`` if it is a regular file with a single link; else closed (when ``close``) and refused."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return fd
    if close:
        os.close(fd)
    what = "a hard-linked file" if stat.S_ISREG(st.st_mode) else "not a regular file"
    raise NotAFileError(errno.EPERM, f"is {what}; the copy writes and reads only files it made itself")
