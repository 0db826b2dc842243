"""Helpers of the destination tree: names, DEST itself, space, preallocation, whole-buffer I/O.

A file is written under a temporary name next to its final one, fsynced, then renamed,
so a file under its final name is always complete. The temporary name is fixed for a
given path, so a rerun after a crash replaces it instead of piling up. Everything below
DEST is opened through :class:`azcp_cluster.dest.desttree.DestTree`, never by a path string.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import stat
from collections.abc import Callable

import numpy as np

from azcp_cluster.core.errors import LocalFSError
from azcp_cluster.core.naming import TEMP_SUFFIX


def expand_dest(template: str, rank: int, host: str) -> str:
    """Expand ``{rank}`` and ``{host}`` in DEST; other text is kept as written."""
    return template.replace("{rank}", str(rank)).replace("{host}", host)


BOOT_ID = "/proc/sys/kernel/random/boot_id"
MOUNTINFO = "/proc/self/mountinfo"
_ESCAPE = re.compile(rb"\\([0-7]{3})")


def machine_id() -> str:
    """The kernel this process runs on: Linux's boot id, the same in every container and
    namespace of one machine and new at every boot ("" where it cannot be read). Two ranks
    with one boot id see one set of devices and inodes: the same numbers are the same file."""
    try:
        with open(BOOT_ID, encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, ValueError):
        return ""


def _unescape(field: bytes) -> str:
    """A path of /proc/self/mountinfo as it is (the kernel writes space, tab, newline and
    backslash as octal escapes)."""
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, root inside its filesystem, device) of every mount this process sees, in
    the kernel's order (a mount stacked on another comes after it); [] where unknown."""
    try:
        with open(MOUNTINFO, "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields = line.split(b" ")
        if len(fields) >= 5:
            mounts.append((_unescape(fields[4]), _unescape(fields[3]), fields[2].decode("ascii", "replace")))
    return mounts


def mount_points_below(real: str) -> set[str]:
    """The mount points strictly below the directory at the real path ``real``, as paths
    relative to it (a bind mount of a tree of the same filesystem too, which its device does
    not tell)."""
    top = real.rstrip("/") + "/"
    return {point[len(top) :] for point, _, _ in _mounts() if point.startswith(top) and len(point) > len(top)}


def locate_dest(real: str) -> tuple[str, str, str]:
    """Where the directory at the real path ``real`` lies on this machine, whether or not it
    exists yet: ``(directory, mount, within)``.

    ``directory`` is its device and inode (of ``real``, or of its deepest existing ancestor
    followed by the rest of the path): two paths to one directory (a bind mount, two
    containers mounting one host directory at different places) give the same. ``mount`` and
    ``within`` are the device of the filesystem it is on and its path inside that filesystem
    (the mount's root in /proc/self/mountinfo and the path below the mount point), so a
    directory inside another shows as a longer path on the same filesystem, whichever mount
    each is reached through. Without mountinfo: "" and ``real``.
    """
    path, rest = real, ""
    while True:
        try:
            st = os.stat(path)
            break
        except OSError:
            parent, name = os.path.split(path)
            if parent == path:
                return f"?:{real}", "", real  # not even "/": the path alone
            path, rest = parent, name if not rest else f"{name}/{rest}"
    directory = f"{st.st_dev}:{st.st_ino}:{rest}"
    # The mount ``path`` is on: the deepest mount point above it, the last mounted there; one
    # of the device ``path`` has, if any (a mount since stacked over a shallower point hides a
    # deeper one; btrfs subvolumes show a device of their own).
    mounts = [m for m in _mounts() if path == m[0] or path.startswith(m[0].rstrip("/") + "/")]
    if not mounts:
        return directory, "", real
    mounts.reverse()
    mounts.sort(key=lambda m: len(m[0]), reverse=True)  # stable: the last mounted first among equals
    own = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    mount_point, root, device = next((m for m in mounts if m[2] == own), mounts[0])
    within = root.rstrip("/") + path[len(mount_point.rstrip("/")) :]
    within = os.path.join(within or "/", rest) if rest else within or "/"
    return directory, device, within.rstrip("/") or "/"


def final_path(dest: str, rel: str) -> str:
    """Where file ``rel`` lives under ``dest``."""
    return os.path.join(dest, *rel.split("/"))


def temp_name(base: str) -> str:
    """The temporary name of the file named ``base``, in the same directory."""
    return f".{base}{TEMP_SUFFIX}"


def temp_path(dest: str, rel: str) -> str:
    """The temporary name file ``rel`` is written under before its rename."""
    head, _, base = rel.rpartition("/")
    name = temp_name(base)
    return os.path.join(dest, *head.split("/"), name) if head else os.path.join(dest, name)


def fs_error(exc: OSError, path: str, action: str) -> LocalFSError:
    """Turn an OSError into the project's error, with the cause in words.

    A full disk or quota is flagged (``no_space``) so the run can add what it needed.
    """
    cause = exc.strerror or str(exc)
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if exc.errno == errno.ENOSPC:
        cause = "no space left on device"
    error = LocalFSError(f"cannot {action}: {cause}", path=path)
    error.no_space = full  # type: ignore[attr-defined]
    return error


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_space(dest: str, needed: int) -> None:
    """Refuse to start writing ``needed`` bytes into ``dest`` if its filesystem has less free."""
    try:
        free = free_bytes(dest)
    except OSError:
        return  # a filesystem that cannot say: find out when writing
    if needed > free:
        raise LocalFSError(
            f"not enough space for the files to copy: {needed} bytes needed, {free} bytes free", path=dest
        )


class Made:
    """The directories a run made for DEST, the deepest last, each held open (so that its inode
    cannot be reused by another directory while the run lasts)."""

    def __init__(self) -> None:
        self.dirs: list[tuple[str, int]] = []  # (path, an O_DIRECTORY descriptor of what was made)
        self.shared: set[str] = set()  # directories the run's other writers on this machine made

    def __bool__(self) -> bool:
        return bool(self.dirs)

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.dirs]

    def remove(self) -> None:
        """Remove them, the deepest first, each only if it is still the directory made (not
        followed through a link) and empty; what cannot be removed stays. Then the parents
        above that the run's other writers on this machine made, each if empty: the last
        writer to remove its DEST removes them. Never raises."""
        own = dict(self.dirs)
        above = {path for path in self.shared if any(mine.startswith(path.rstrip("/") + "/") for mine in own)}
        for path in sorted(set(own) | above, key=lambda p: p.count("/"), reverse=True):
            try:
                st = os.lstat(path)
                if not stat.S_ISDIR(st.st_mode):
                    continue
                if path in own:
                    made = os.fstat(own[path])
                    if (st.st_dev, st.st_ino) != (made.st_dev, made.st_ino):
                        continue  # another directory at the name now: not this run's
                os.rmdir(path)  # only an empty directory: anything put in it keeps it
            except OSError:
                continue
        self.close()

    def close(self) -> None:
        """Let them be (the run succeeded, or wrote into DEST)."""
        dirs, self.dirs = self.dirs, []
        for _, fd in dirs:
            with contextlib.suppress(OSError):
                os.close(fd)


def ensure_dest(dest: str, create: bool = True) -> Made:
    """Make sure DEST is a writable directory (created with parents when ``create``).

    Returns the directories this call made, the deepest last: a run that fails before it
    writes anything removes them again if they are still empty (:meth:`Made.remove`), and
    nothing else; otherwise :meth:`Made.close`.
    """
    try:
        st = os.stat(dest)
    except FileNotFoundError:
        if os.path.islink(dest):
            raise LocalFSError(
                f"DEST is a symbolic link to {os.readlink(dest)!r}, which does not exist; create it or fix the link",
                path=dest,
            ) from None
        if not create:
            return Made()
        try:
            return _make_dirs(dest)
        except OSError as exc:
            raise fs_error(exc, dest, "create DEST") from None
    except OSError as exc:
        raise fs_error(exc, dest, "inspect DEST") from None
    if not stat.S_ISDIR(st.st_mode):
        raise LocalFSError("DEST exists and is not a directory", path=dest)
    if create and not os.access(dest, os.W_OK | os.X_OK):
        raise LocalFSError("DEST is not writable", path=dest)
    return Made()


def _make_dirs(dest: str) -> Made:
    """``os.makedirs(dest)`` one directory at a time: those this call made (a directory that
    another process made meanwhile is theirs, not listed)."""
    missing = []
    path = dest.rstrip("/") or "/"  # not normalised: "link/.." is where the kernel says
    while path and not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    made = Made()
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # replaced at once: not ours to remove
            made.dirs.append((path, fd))
    except BaseException:
        made.close()
        raise
    return made


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's fallocate(2), or None where there is none (not Linux, a 32-bit off_t).

    Not ``os.posix_fallocate``: where the filesystem cannot preallocate (NFSv3, many FUSE
    filesystems), glibc emulates it by writing every block, which would write each file
    twice.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    for name in ("fallocate64", "fallocate"):
        function = getattr(libc, name, None)
        if function is None or (name == "fallocate" and ctypes.sizeof(ctypes.c_long) < 8):
            continue  # a 32-bit platform's plain fallocate takes a 32-bit offset
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        function.restype = ctypes.c_int
        return function  # type: ignore[no-any-return]
    return None


_FALLOCATE = _load_fallocate()


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's syncfs(2), where it reports write-back errors (Linux 5.8 and later); else None.

    Before 5.8 syncfs returned 0 even when writing back failed: an I/O error would go unseen,
    so the files are then synced one by one instead.
    """
    try:
        major, minor = (int(part) for part in os.uname().release.split(".")[:2])
        libc = ctypes.CDLL(None, use_errno=True)
    except (OSError, ValueError):
        return None
    function = getattr(libc, "syncfs", None)
    if function is None or (major, minor) < (5, 8):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_SYNCFS = _load_syncfs()


def _load_statfs() -> Callable[[bytes, ctypes.Array[ctypes.c_char]], int] | None:
    """libc's statfs(2) (Python has only statvfs, which does not say the filesystem's type)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "statfs64", None) or getattr(libc, "statfs", None)
    if function is None:
        return None
    function.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_STATFS = _load_statfs()


def filesystem_type(path: str) -> int | None:
    """The magic number of the filesystem holding ``path`` (statfs's ``f_type``, links followed),
    or None where it cannot be had."""
    if _STATFS is None:
        return None
    buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
    if _STATFS(os.fsencode(path), buf) != 0:
        return None
    # f_type is the struct's first member, a long; the magic numbers are 32 bits wide.
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def syncfs(fd: int) -> bool:
    """Write back everything cached for the filesystem of ``fd`` (one call for any number of
    files). Returns False where syncfs is not to be trusted (see :func:`_load_syncfs`): the
    caller syncs file by file. Raises OSError for a write-back error.
    """
    if _SYNCFS is None:
        return False
    if _SYNCFS(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return True


# The filesystem cannot preallocate: the file is extended (sparse) instead.
_NO_PREALLOCATION = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


def preallocate(fd: int, size: int) -> bool:
    """Make the open, empty file ``fd`` ``size`` bytes long, its blocks reserved where possible.

    Returns whether the blocks were reserved (``fallocate``); where the filesystem cannot,
    the file is only extended (``ftruncate``, a sparse file). Reserved blocks matter for
    the O_DIRECT writers: a direct write into a hole allocates as it goes, and ext4 holds
    the inode lock exclusively for the whole of such a write, where writes into reserved
    blocks of one file run at once. Reserving also finds a full disk before any byte is
    downloaded, and lays each file out in a few large extents. (The download stage, ext4
    on the test VM: 10 to 14% faster in two paired runs; see docs/benchmarks.md.)
    Raises OSError for anything else (ENOSPC, EDQUOT, EFBIG, EIO).
    """
    if size and _FALLOCATE is not None:
        while True:
            if _FALLOCATE(fd, 0, 0, size) == 0:
                return True
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            if code not in _NO_PREALLOCATION:
                raise OSError(code, os.strerror(code))
            break
    os.ftruncate(fd, size)
    return False


def pwritev_all(fd: int, buffers: list[memoryview] | list[bytes], offset: int) -> int:
    """Write every byte of ``buffers`` at ``offset``, looping over short writes."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    total = 0
    while views:
        written = os.pwritev(fd, views, offset)
        if written <= 0:
            raise OSError(errno.EIO, "write returned no progress")
        total += written
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
    return total


def preadv_all(fd: int, buf: np.ndarray, offset: int, block: int = 1) -> int:
    """Fill ``buf`` from ``offset``, looping over short reads (Linux reads at most ~2 GiB a call).

    Returns the bytes read: less than ``len(buf)`` at end of file, or where a read came back
    short of a multiple of ``block`` (O_DIRECT reads, which can only go on from an aligned
    offset, pass the alignment).
    """
    view = memoryview(buf)  # type: ignore[arg-type]
    total = 0
    while total < len(view):
        got = os.preadv(fd, [view[total:]], offset + total)
        if got <= 0:
            break
        total += got
        if got % block:
            break
    return total
