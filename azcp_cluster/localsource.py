"""A local or shared-filesystem SOURCE (the ``mpi-stage`` case): list it on the one reader.

Only the reading rank calls into this module (everyone else receives the bytes over MPI),
so a shared filesystem sees one client, not one per node. The tree is listed with the same
rules as a blob prefix (filters, name safety, collisions: ``naming.select``), so both kinds
of SOURCE give the same DEST layout. A local file has no ETag; its identity for
``--compare etag`` is its size and modification time, as ``rsync`` and ``make`` use.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import NamedTuple

from azcp_cluster.config import Config
from azcp_cluster.errors import ListError, SourceError, UsageError
from azcp_cluster.model import FileEntry, Listing
from azcp_cluster.naming import JOURNAL_DIR, LOCK_NAME, MANIFEST_NAME, TEMP_SUFFIX, RawEntry, select
from azcp_cluster.syscalls import CallPool


def local_etag(st: os.stat_result) -> str:
    """A stand-in ETag for a local file: changes whenever its size or mtime does."""
    return f'"{st.st_mtime_ns:x}-{st.st_size:x}"'


def _entry(name: str, st: os.stat_result) -> RawEntry:
    return RawEntry(name=name, size=st.st_size, etag=local_etag(st), last_modified=st.st_mtime)


# Names stat'ed per batch: a huge directory is spread over the threads too.
STAT_BATCH = 1024
_stat_entry = os.DirEntry.stat  # a seam: the tests fail one stat to see the walk stop


def _scan(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError as exc:
        raise ListError(f"cannot list a directory of SOURCE: {exc.strerror}", path=path) from None


class _Stated(NamedTuple):
    """What one batch of a directory's children turned out to be."""

    calls: int
    entries: list[RawEntry]  # regular files: data
    dirs: list[tuple[str, str, os.stat_result]]  # (relative name, path, stat) to walk next
    not_data: int  # special files and the tool's own files
    dangling: list[str]


def _stat_batch(batch: tuple[str, list[os.DirEntry[str]]]) -> _Stated:
    """Stat each child of a directory (following links) and sort it by what it is."""
    rel_dir, children = batch
    entries: list[RawEntry] = []
    dirs: list[tuple[str, str, os.stat_result]] = []
    not_data = 0
    dangling: list[str] = []
    for child in children:
        rel = f"{rel_dir}{child.name}"
        try:
            st = _stat_entry(child, follow_symlinks=True)
        except FileNotFoundError:
            if not child.is_symlink():
                raise ListError("a file of SOURCE disappeared while it was listed", path=child.path) from None
            dangling.append(child.path)  # its target is gone: not data, counted and named once
            continue
        except OSError as exc:
            raise ListError(f"cannot stat a file of SOURCE: {exc.strerror}", path=child.path) from None
        if stat.S_ISDIR(st.st_mode):
            if rel == JOURNAL_DIR:
                not_data += 1  # an earlier DEST's block journal is not data either
            else:
                dirs.append((rel, child.path, st))
        elif rel in (MANIFEST_NAME, LOCK_NAME) or rel.endswith(TEMP_SUFFIX):
            not_data += 1  # staging from an earlier DEST: its manifest and leftovers are not data
        elif stat.S_ISREG(st.st_mode):
            entries.append(_entry(rel, st))
        else:
            not_data += 1  # sockets, FIFOs, devices
    return _Stated(len(children), entries, dirs, not_data, dangling)


def _walk(root: str, top: os.stat_result) -> tuple[list[RawEntry], int, list[str]]:
    """The regular files below ``root``, the count of what is not data (special files, the
    tool's own files) and the dangling links.

    One depth at a time: its directories are listed, then their children stat'ed in batches,
    each through a :class:`~azcp_cluster.syscalls.CallPool` (threads where the calls are
    slow), the results in the level's order.
    """
    entries: list[RawEntry] = []
    not_data = 0
    dangling: list[str] = []
    seen = {(top.st_dev, top.st_ino)}
    with CallPool() as calls:
        level = [("", root)]
        while level:
            listed = calls.map(_scan, [path for _, path in level], calls=lambda children: 1 + len(children))
            batches = [
                (rel_dir, children[at : at + STAT_BATCH])
                for (rel_dir, _), children in zip(level, listed, strict=True)
                for at in range(0, len(children), STAT_BATCH)
            ]
            found: list[tuple[str, str, os.stat_result]] = []
            for stated in calls.map(_stat_batch, batches, calls=lambda stated: stated.calls):
                entries.extend(stated.entries)
                found.extend(stated.dirs)
                not_data += stated.not_data
                dangling.extend(stated.dangling)
            # A directory reached twice (a symlink loop, the same tree twice) is walked once,
            # under its shallowest, then first-sorting name: the same whatever the filesystem's
            # order of names.
            level = []
            for rel, path, st in sorted(found, key=lambda item: item[0]):
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    level.append((rel + "/", path))
    return entries, not_data, dangling


def list_local(root: str, cfg: Config) -> Listing:
    """List ``root`` (a file, or a directory walked recursively, symlinks followed).

    A single file is copied to ``DEST/<its name>``; a directory's files keep their path
    below it. Sockets, FIFOs and devices are not data, nor are the tool's own manifest, lock
    and temporary files (a SOURCE that was once a DEST): they are left out and counted with
    the filtered files. A manifest or lock file deeper in the tree, or a directory named like
    a temporary file, is refused like such a blob name (``naming.check_relative_path``). A
    directory reached twice through symlinks is walked once, under its shallowest name (then
    the first in name order). The stat calls go to threads where they are slow (a shared
    filesystem): azcp_cluster/syscalls.py.
    """
    try:
        top = os.stat(root)
    except OSError as exc:
        raise ListError(f"cannot read SOURCE: {exc.strerror}", path=root) from None
    if stat.S_ISREG(top.st_mode):
        name = os.path.basename(os.path.normpath(root))
        return select(name, _entry(name, top), (), cfg.include, cfg.exclude)
    if not stat.S_ISDIR(top.st_mode):
        raise UsageError(f"SOURCE {root!r} is neither a regular file nor a directory")
    entries, not_data, dangling = _walk(root, top)
    listing = select("", None, entries, cfg.include, cfg.exclude)
    if dangling:
        print(
            f"azcp-cluster: warning: skipped {len(dangling)} dangling symbolic link(s) in SOURCE "
            f"(e.g. {dangling[0]!r}: its target does not exist)",
            file=sys.stderr,
            flush=True,
        )
    skipped = not_data + len(dangling)
    return Listing(files=listing.files, markers_skipped=0, filtered_out=listing.filtered_out + skipped)


def restat(root: str, entry: FileEntry, single: bool) -> FileEntry:
    """``entry`` as its file is now (size, modification time): to read a file again that changed.

    A file that is gone, or no longer a regular file, is a :class:`SourceError`.
    """
    path = source_file(root, entry.name, single)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SourceError("the file was deleted while it was read", path=path) from None
    except OSError as exc:
        raise SourceError(f"cannot read the file: {exc.strerror}", path=path) from None
    if not stat.S_ISREG(st.st_mode):
        raise SourceError("the file was replaced by something that is not a regular file", path=path)
    return entry._replace(size=st.st_size, etag=local_etag(st), last_modified=st.st_mtime)


def source_file(root: str, name: str, single: bool) -> str:
    """The path the reader opens for the listed ``name`` (``root`` itself for a single file)."""
    return root if single else os.path.join(root, *name.split("/"))


def check_overlap(source_real: str, dest_real: str) -> None:
    """Refuse a DEST that is the SOURCE directory or lies inside it (the copy would list itself)."""
    if dest_real == source_real or dest_real.startswith(source_real.rstrip("/") + "/"):
        raise UsageError(f"DEST {dest_real} is inside SOURCE {source_real}; choose a directory outside it")
