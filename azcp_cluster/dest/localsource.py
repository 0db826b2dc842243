"""A local or shared-filesystem SOURCE (the ``mpi-stage`` case): list it on the one reader.

Only the reading rank calls into this module (everyone else receives the bytes over MPI),
so a shared filesystem sees one client, not one per node. The tree is listed with the same
rules as a blob prefix (filters, name safety, collisions: ``naming.select``), so both kinds
of SOURCE give the same DEST layout.

A local file has no ETag. Its stand-in (:func:`local_etag`), what ``--compare etag`` and the
block journal's resume tie a copy to, is its size, modification time, change time and inode
number: a rewrite that keeps the size and puts the mtime back (``cp -p``, ``rsync -t``,
``tar x``, a build with a fixed ``SOURCE_DATE_EPOCH``) still moves the change time, which no
user can set, and a file put in another's place has its own inode. That holds only where
the filesystem keeps change times (:data:`CTIME_KEEPING`) and only for a change later than
the filesystem's timestamp granularity after the one the listing saw: a file whose change
time is not :data:`SETTLED_NS` behind the reader's clock when the listing starts, or that
lies on another filesystem (FUSE mounts such as blobfuse, FAT, read-only images), gets a
*weak* ETag (``W/"..."``, as HTTP marks a validator that cannot vouch for byte ranges): no
block of it is resumed, it is copied whole (journal.tag). The identity is read by the one
rank that lists SOURCE and travels in the listing, so every rank ties its blocks to the
same version; the device number is left out (it differs between the clients of one
shared filesystem, and a later run may list on another node).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from typing import NamedTuple

from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import ListError, SourceError, UsageError
from azcp_cluster.core.model import FileEntry, Listing
from azcp_cluster.core.naming import JOURNAL_DIR, LOCK_NAME, MANIFEST_NAME, TEMP_SUFFIX, RawEntry, select
from azcp_cluster.dest.localfs import filesystem_type
from azcp_cluster.dest.syscalls import CallPool
from azcp_cluster.run.console import say

# A file's identity is believed only once its change time is this far behind the reader's
# clock at the listing: more than the coarsest timestamp granularity of the filesystems
# below (1 s: ext4 with small inodes, Lustre, an NFS server's ext3) plus the kernel's coarse
# clock (a jiffy behind). A later change then gets a later change time. It assumes the
# clock that stamps the file (an NFS or Lustre server's, a writing client's) is within a
# second of the reader's, as NTP keeps it.
SETTLED_NS = 2_000_000_000

# statfs(2) magic numbers of the filesystems that set a file's change time to the current
# time at every change of its data or inode, and offer no way to set it: where the identity
# can be believed. Anything else (FUSE, where the daemon reports what it likes: blobfuse,
# s3fs, sshfs; FAT and exFAT, which keep no change time; squashfs, erofs and ISO images,
# whose times come from the image) is never trusted.
CTIME_KEEPING = {
    0xEF53: "ext2/ext3/ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x3153464A: "jfs",
    0x52654973: "reiserfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlay",
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x19830326: "beegfs",
    0x00C36400: "ceph",
}


def identity(st: os.stat_result) -> str:
    """What a local file is, as one stat says: size, mtime, ctime and inode (see the module)."""
    # %-formatting: half the cost of an f-string's {:x} here, once per file of every listing.
    return '"%x-%x-%x-%x"' % (st.st_mtime_ns, st.st_size, st.st_ctime_ns, st.st_ino)  # noqa: UP031


def local_etag(st: os.stat_result, trusted: bool) -> str:
    """A local file's stand-in ETag: its :func:`identity`, weak (``W/``) unless ``trusted``."""
    return identity(st) if trusted else f"W/{identity(st)}"


def as_listed(st: os.stat_result, etag: str) -> bool:
    """Whether a file stat'ed now is the version whose (strong or weak) ETag was listed."""
    return etag.removeprefix("W/") == identity(st)


def trusted(fs_type: int | None, ctime_ns: int, now_ns: int) -> bool:
    """Whether a file's identity can be believed: on a filesystem that keeps change times,
    and last changed at least :data:`SETTLED_NS` before ``now_ns`` (see the module)."""
    return fs_type in CTIME_KEEPING and ctime_ns <= now_ns - SETTLED_NS


class Trust:
    """Which files of one listing get a strong ETag: :func:`trusted`, against the reader's
    clock when the listing began, each device's filesystem type asked once."""

    def __init__(self, now_ns: int | None = None, fs_type: Callable[[str], int | None] | None = None) -> None:
        self.now_ns = time.time_ns() if now_ns is None else now_ns
        self._fs_type = filesystem_type if fs_type is None else fs_type
        self._keeps: dict[int, bool] = {}  # device -> its filesystem keeps change times

    def etag(self, path: str, st: os.stat_result) -> str:
        """The ETag of the file at ``path`` whose stat is ``st`` (:func:`local_etag` as
        :func:`trusted` says, written out: it runs once per file of every listing)."""
        keeps = self._keeps.get(st.st_dev)
        if keeps is None:  # (two threads may both ask: the same answer)
            keeps = self._keeps[st.st_dev] = self._fs_type(path) in CTIME_KEEPING
        ident = identity(st)
        return ident if keeps and st.st_ctime_ns <= self.now_ns - SETTLED_NS else "W/" + ident


def _entry(name: str, path: str, st: os.stat_result, trust: Trust) -> RawEntry:
    return RawEntry(name=name, size=st.st_size, etag=trust.etag(path, st), last_modified=st.st_mtime)


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
    dangling: list[str]  # relative names of links whose target is gone


def _stat_batch(batch: tuple[str, list[os.DirEntry[str]], Trust]) -> _Stated:
    """Stat each child of a directory (following links) and sort it by what it is."""
    rel_dir, children, trust = batch
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
            dangling.append(rel)  # its target is gone: not data, counted and named once
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
            entries.append(_entry(rel, child.path, st, trust))
        else:
            not_data += 1  # sockets, FIFOs, devices
    return _Stated(len(children), entries, dirs, not_data, dangling)


class _Walked(NamedTuple):
    """What a walk of a SOURCE directory found."""

    entries: list[RawEntry]  # the regular files
    not_data: int  # special files, the tool's own files
    dangling: list[str]  # relative names of links whose target is gone
    aliases: list[str]  # relative names of directories not walked: reached under another name


def _walk(root: str, top: os.stat_result, trust: Trust) -> _Walked:
    """The regular files below ``root``, the count of what is not data (special files, the
    tool's own files), the dangling links and the directories walked under another name.

    One depth at a time: its directories are listed, then their children stat'ed in batches,
    each through a :class:`~azcp_cluster.dest.syscalls.CallPool` (threads where the calls are
    slow), the results in the level's order.
    """
    entries: list[RawEntry] = []
    not_data = 0
    dangling: list[str] = []
    aliases: list[str] = []
    seen = {(top.st_dev, top.st_ino)}
    with CallPool() as calls:
        level = [("", root)]
        while level:
            listed = calls.map(_scan, [path for _, path in level], calls=lambda children: 1 + len(children))
            batches = [
                (rel_dir, children[at : at + STAT_BATCH], trust)
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
            # order of names. The other names are kept (aliases): SOURCE has them, with files.
            level = []
            for rel, path, st in sorted(found, key=lambda item: item[0]):
                if (st.st_dev, st.st_ino) in seen:
                    aliases.append(rel)
                else:
                    seen.add((st.st_dev, st.st_ino))
                    level.append((rel + "/", path))
    return _Walked(entries, not_data, dangling, aliases)


def list_local(root: str, cfg: Config) -> Listing:
    """List ``root`` (a file, or a directory walked recursively, symlinks followed).

    A single file is copied to ``DEST/<its name>``; a directory's files keep their path
    below it. Sockets, FIFOs and devices are not data, nor are the tool's own manifest, lock
    and temporary files (a SOURCE that was once a DEST): they are left out and counted with
    the filtered files. A manifest or lock file deeper in the tree, or a directory named like
    a temporary file, is refused like such a blob name (``naming.check_relative_path``). A
    directory reached twice through symlinks is walked once, under its shallowest name (then
    the first in name order). The listing names the dangling links and the directory's other
    names (``Listing.dangling``, ``Listing.aliases``): ``--delete`` removes nothing at or
    below them (dest/mirror.choose). The stat calls go to threads where they are slow (a shared
    filesystem): azcp_cluster/dest/syscalls.py.
    """
    trust = Trust()  # the clock read before any stat: a file changed meanwhile is not settled
    try:
        top = os.stat(root)
    except OSError as exc:
        raise ListError(f"cannot read SOURCE: {exc.strerror}", path=root) from None
    if stat.S_ISREG(top.st_mode):
        name = os.path.basename(os.path.normpath(root))
        return select(name, _entry(name, root, top, trust), (), cfg.include, cfg.exclude)
    if not stat.S_ISDIR(top.st_mode):
        raise UsageError(f"SOURCE {root!r} is neither a regular file nor a directory")
    walked = _walk(root, top, trust)
    listing = select("", None, walked.entries, cfg.include, cfg.exclude)
    dangling = sorted(walked.dangling)
    if dangling:
        example = os.path.join(root, *dangling[0].split("/"))
        say(
            f"azcp-cluster: warning: skipped {len(dangling)} dangling symbolic link(s) in SOURCE "
            f"(e.g. {example!r}: its target does not exist)"
        )
    return Listing(
        files=listing.files,
        markers_skipped=0,
        filtered_out=listing.filtered_out + walked.not_data + len(dangling),
        dangling=tuple(dangling),
        aliases=tuple(sorted(walked.aliases)),
    )


def restat(root: str, entry: FileEntry, single: bool) -> FileEntry:
    """``entry`` as its file is now (size, identity): to read a file again that changed (its
    ETag weak: it changed just now).

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
    return entry._replace(size=st.st_size, etag=Trust().etag(path, st), last_modified=st.st_mtime)


def source_file(root: str, name: str, single: bool) -> str:
    """The path the reader opens for the listed ``name`` (``root`` itself for a single file)."""
    return root if single else os.path.join(root, *name.split("/"))


def check_overlap(source_real: str, dest_real: str) -> None:
    """Refuse a DEST that is the SOURCE directory or lies inside it (the copy would list itself),
    and a SOURCE that lies inside DEST: the copy would land around what it reads (a file
    SOURCE ``DEST/f`` lands as ``DEST/f``, over itself; from a directory ``DEST/sub``, a listed
    ``sub/x`` is written over the listed ``x``), and whatever later clears DEST takes SOURCE
    with it. Both are one rank's real paths (resolved as far as they exist); each rank checks
    its own DEST, as DESTs differ by node."""
    if dest_real == source_real or dest_real.startswith(source_real.rstrip("/") + "/"):
        raise UsageError(f"DEST {dest_real} is inside SOURCE {source_real}; choose a directory outside it")
    if source_real.startswith(dest_real.rstrip("/") + "/"):
        raise UsageError(f"SOURCE {source_real} is inside DEST {dest_real}; choose a DEST outside it")
