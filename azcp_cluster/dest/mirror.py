"""``--delete`` (a mirror): which files under DEST that SOURCE no longer has are removed, and removing them.

The rules (:func:`choose`, pure, property-tested in tests/test_mirror.py), for each entry a
walk of DEST found (:func:`walk`):

* only a **regular file with one link** is ever a candidate: a symbolic link (to a file or a
  directory, inside DEST or out), a hard-linked file, a FIFO, a socket or a device is left
  alone: the tool never placed one, and removing a name another file shares is no mirror;
* only a path the filters select (``--include``/``--exclude``, as the listing applies them)
  is a candidate: an excluded file is not part of the mirror and stays (rclone sync's rule);
* a listed path is never a candidate (the run has just copied it, or found it there);
* nothing at or below a *sheltered* path is a candidate: one SOURCE has though the listing
  names no file under it, a link in a local SOURCE whose target is gone (a share unmounted
  for a moment: what lies behind it is unknown, not absent) or a directory of a local SOURCE
  listed under another name (reached twice, walked once: ``Listing.dangling``,
  ``Listing.aliases``);
* the tool's own files are never candidates: the manifest, the lock file, the block journal
  (``.azcp-journal``, a directory at a DEST's top) and temporary names (``*.azcp-part``), at
  any depth.

The walk itself (:func:`walk`) reaches every directory from DEST's root descriptor one
component at a time (``O_NOFOLLOW | O_DIRECTORY``) and never descends into a symbolic link,
the block journal, a directory that holds the tool's manifest, lock file or block journal
(another DEST nested below this one, perhaps written by another run at this moment, or one
whose run was stopped: it left its journal, and no manifest yet), or a mount point (another
filesystem, or a bind mount of a tree from elsewhere).

:func:`remove` unlinks each chosen file by name relative to its directory's descriptor
(``unlinkat``: a link is never followed, and no path leaves DEST's real path), only if the
name still is the very file the walk found (device, owner, inode, size and modification
time): a file replaced or rewritten since the walk, or one that appeared after it, stays.
Then each directory the removals emptied is removed (``rmdir`` fails on one that is not
empty), deepest first, never DEST itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Sequence, Set
from typing import NamedTuple

from azcp_cluster.core.errors import LocalFSError
from azcp_cluster.core.naming import JOURNAL_DIR, LOCK_NAME, MANIFEST_NAME, TEMP_SUFFIX, matches_filters
from azcp_cluster.dest.destroot import DIR_FLAGS, DestRoot, identity, split
from azcp_cluster.dest.localfs import fs_error, mount_points_below

# Kinds of entry a walk reports.
FILE = "file"  # a regular file with one link: the only kind ever removed
LINK = "link"
DIR = "dir"
MOUNT = "mount"  # a directory on another filesystem, or a mount point, below DEST: not descended
OTHER = "other"  # a hard-linked file, a FIFO, a socket, a device
# The removed paths the JSON report names (the counts cover them all).
REPORTED_PATHS = 1000


class Entry(NamedTuple):
    """One name below DEST as the walk found it (``rel``: its path below DEST, '/'-separated)."""

    rel: str
    kind: str
    size: int = 0
    ident: int = 0  # destroot.identity: device, owner, inode
    mtime_ns: int = 0


class Removed(NamedTuple):
    """What :func:`remove` did on one node."""

    paths: tuple[str, ...]
    bytes: int
    kept: tuple[str, ...]  # chosen, but changed or gone since the walk: left as they are


def tool_owned(rel: str) -> bool:
    """Whether ``rel`` is one of the tool's own files, at any depth: manifest, lock, journal
    (or below it), a temporary name. No SOURCE name has such a segment (naming.py refuses it)."""
    return any(p in (MANIFEST_NAME, LOCK_NAME, JOURNAL_DIR) or p.endswith(TEMP_SUFFIX) for p in rel.split("/"))


def sheltered(rel: str, shelter: Set[str]) -> bool:
    """Whether ``rel`` is one of the ``shelter`` paths, or lies below one (whole segments:
    ``model`` shelters ``model/w.bin``, not ``model2/w.bin``)."""
    at = len(rel) if shelter else -1
    while at > 0:
        if rel[:at] in shelter:
            return True
        at = rel.rfind("/", 0, at)
    return False


def choose(
    listed: Iterable[str],
    found: Iterable[Entry],
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    shelter: Iterable[str] = (),
) -> list[Entry]:
    """The entries of ``found`` that ``--delete`` removes, in path order (see the module's rules).

    ``listed``: the paths of the listing (after the filters); ``found``: what a walk of DEST
    saw; ``shelter``: the paths nothing at or below which is removed (:func:`sheltered`).
    """
    keep = set(listed)
    kept_below = set(shelter)
    chosen = (
        e
        for e in found
        if e.kind == FILE and e.rel not in keep and not tool_owned(e.rel) and not sheltered(e.rel, kept_below)
    )
    return sorted((e for e in chosen if matches_filters(e.rel, include, exclude)), key=lambda e: e.rel)


def descend(rel: str, names: Iterable[str]) -> bool:
    """Whether the walk goes into directory ``rel`` holding ``names``: not the block journal,
    nor another DEST nested below this one (its manifest, lock file or block journal is there:
    a stopped run leaves its journal, and no manifest or lock)."""
    if rel == JOURNAL_DIR:
        return False
    return not any(name in (MANIFEST_NAME, LOCK_NAME, JOURNAL_DIR) for name in names)


def _kind(st: os.stat_result, device: int | None = None, mounted: bool = False) -> str:
    """What ``st`` is to the walk (``device``: DEST's filesystem; ``mounted``: a mount point is
    there; a directory of either kind is a mount, not descended)."""
    if stat.S_ISLNK(st.st_mode):
        return LINK
    if stat.S_ISDIR(st.st_mode):
        return MOUNT if mounted or (device is not None and st.st_dev != device) else DIR
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return FILE
    return OTHER


def walk(tree: DestRoot) -> list[Entry]:
    """Every name below DEST (a DEST that does not exist: none), without following a link.

    A directory that cannot be opened as one (swapped for a link since it was seen) is not
    descended; a directory that cannot be read is an error naming it.
    """
    if not tree.exists:
        return []
    found: list[Entry] = []
    pending: list[str] = [""]
    device = os.fstat(tree.fd).st_dev
    mounts = mount_points_below(tree.real)
    while pending:
        rel_dir = pending.pop()
        try:
            fd = os.open(rel_dir, DIR_FLAGS, dir_fd=tree.fd) if rel_dir else os.dup(tree.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                continue  # replaced by a link or a file since it was seen, or gone: not ours to walk
            raise fs_error(exc, tree.shown(rel_dir), "read directory") from None
        try:
            names = os.listdir(fd)
            if rel_dir and not descend(rel_dir, names):
                continue
            for name in names:
                rel = f"{rel_dir}/{name}" if rel_dir else name
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since the listing of its directory
                kind = _kind(st, device, rel in mounts)
                entry = Entry(rel, kind, st.st_size, identity(st), st.st_mtime_ns)
                found.append(entry)
                if entry.kind == DIR:
                    pending.append(rel)
        except OSError as exc:
            raise fs_error(exc, tree.shown(rel_dir), "read directory") from None
        finally:
            os.close(fd)
    return found


def remove(tree: DestRoot, chosen: Sequence[Entry]) -> Removed:
    """Unlink each chosen file that is still the file the walk found; then the directories emptied."""
    removed: list[str] = []
    kept: list[str] = []
    nbytes = 0
    for entry in chosen:
        if _unlink_if_same(tree, entry):
            removed.append(entry.rel)
            nbytes += entry.size
        else:
            kept.append(entry.rel)
    _remove_emptied(tree, removed)
    return Removed(tuple(removed), nbytes, tuple(kept))


def _unlink_if_same(tree: DestRoot, entry: Entry) -> bool:
    parts, base = split(entry.rel)
    try:
        with tree.directory(parts) as dfd:
            st = os.stat(base, dir_fd=dfd, follow_symlinks=False)
            if _kind(st) != FILE or (st.st_size, identity(st), st.st_mtime_ns) != (
                entry.size,
                entry.ident,
                entry.mtime_ns,
            ):
                return False  # replaced or rewritten since the walk: not the file the run chose
            os.unlink(base, dir_fd=dfd)
    except (FileNotFoundError, NotADirectoryError, LocalFSError):
        return False  # gone, or a directory on its way is now a link: nothing of the walk's there
    except OSError as exc:
        raise fs_error(exc, tree.shown(entry.rel), "delete file") from None
    return True


def emptied_dirs(removed: Iterable[str]) -> list[str]:
    """The directories that held removed files, and their parents, deepest first (never DEST: "")."""
    dirs: set[str] = set()
    for rel in removed:
        parts = split(rel)[0]
        dirs.update("/".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    return sorted(dirs, key=lambda d: (-d.count("/"), d))


def _remove_emptied(tree: DestRoot, removed: Iterable[str]) -> None:
    """``rmdir`` each directory that held a removed file, deepest first: one still holding
    anything fails (ENOTEMPTY) and stays, and so do its parents."""
    for rel in emptied_dirs(removed):
        parts, base = split(rel)
        with contextlib.suppress(OSError, LocalFSError), tree.directory(parts) as dfd:
            os.rmdir(base, dir_fd=dfd)
