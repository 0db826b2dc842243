"""One run per DEST at a time: an exclusive ``flock`` on ``DEST/.azcp-lock``, held for the whole run.

Two runs writing one DEST (two job steps staging onto one node's NVMe) would truncate and
rewrite each other's temporary files, and one could rename a file the other had zeroed.
So each node's writing rank takes the lock before it inspects or writes anything. The
kernel releases a ``flock`` when its process dies, so a killed run never leaves DEST
locked; the file itself is removed by the run that holds it, at its end.

Across the nodes of a job the lock is all or nothing (:func:`lock_backoff` and the loop in
``pipeline``): every writing rank tries without waiting, the ranks agree, and unless all got
theirs, all release and try again after a random pause. No rank ever waits while holding a
lock, so two jobs that share nodes in opposite orders cannot deadlock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import time

from azcp_cluster.core.errors import LocalFSError
from azcp_cluster.core.naming import LOCK_NAME
from azcp_cluster.dest.destroot import NotAFileError, checked, identity
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.localfs import fs_error

# Pauses between tries grow from 50 ms to 2 s, each drawn at random below its bound, so
# that two jobs retrying together drift apart.
FIRST_PAUSE = 0.05
LONGEST_PAUSE = 2.0
_HOLDER_BYTES = 512  # more than a holder's line (host, pid, time) ever takes
# A holder writes who it is right after it takes the lock: an empty file is read again.
_HOLDER_TRIES = 5
_HOLDER_PAUSE = 0.01


def lock_backoff(attempt: int, rng: random.Random) -> float:
    """Seconds to wait before try ``attempt + 1`` (full jitter, capped)."""
    bound = min(LONGEST_PAUSE, FIRST_PAUSE * 2 ** min(attempt, 16))
    return float(bound / 2 + rng.random() * bound / 2)


class DestLock:
    """The lock file of one DEST, opened (never followed through a link) and not yet held."""

    def __init__(self, tree: DestTree, owner: str) -> None:
        self.tree = tree
        self.owner = owner  # "host pid", written into the file while it is held
        self.held = False
        self.fd = -1
        self._open()

    def _open(self) -> None:
        shown = self.tree.shown(LOCK_NAME)
        try:
            fd = os.open(
                LOCK_NAME,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                0o644,
                dir_fd=self.tree.fd,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LocalFSError("is a symbolic link; remove it (the tool's lock file)", path=shown) from None
            raise fs_error(exc, shown, "open the lock file") from None
        try:
            self.fd = checked(fd)
        except NotAFileError as exc:
            raise LocalFSError(f"{exc.strerror}; remove it (the tool's lock file)", path=shown) from None

    def try_acquire(self) -> str | None:
        """Take the lock without waiting: None when taken, else who holds it ("host pid")."""
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return self._wait_for_holder()
            except OSError as exc:
                raise fs_error(exc, self.tree.shown(LOCK_NAME), "lock DEST") from None
            # The holder before us may have removed the file after we opened it: a lock on a
            # file no longer at the name guards nothing. Open the name again and retry.
            if self._at_the_name():
                break
            os.close(self.fd)
            self.fd = -1
            if self.tree.removed:  # the run before removed DEST itself (it made it, and failed)
                return "the run that made DEST, which has just removed it"
            self._open()
        self.held = True
        with contextlib.suppress(OSError):  # who holds it is for the others' notice only
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{self.owner}\n".encode(), 0)
        return None

    def _wait_for_holder(self) -> str:
        """Who holds the lock; the holder writes it just after it takes the lock, so an empty
        file is given a moment before it counts as unknown."""
        for _ in range(_HOLDER_TRIES):
            text = self.holder()
            if text != "unknown":
                return text
            time.sleep(_HOLDER_PAUSE)
        return "unknown"

    def holder(self) -> str:
        """Who holds the lock, as its holder wrote it ("unknown" if unreadable)."""
        try:
            text = os.pread(self.fd, _HOLDER_BYTES, 0).decode("utf-8", "replace").strip()
        except OSError:
            text = ""
        return text or "unknown"

    def release(self, remove: bool = False) -> None:
        """Give the lock up (and remove the file, at the end of a run)."""
        if not self.held:
            return
        self.held = False
        with contextlib.suppress(OSError):
            if remove and self._at_the_name():
                # Removed while still held: whoever opens the name next makes a new file.
                os.unlink(LOCK_NAME, dir_fd=self.tree.fd)
            else:
                os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _at_the_name(self) -> bool:
        now = self.tree.lstat(LOCK_NAME)
        return now is not None and identity(now) == identity(os.fstat(self.fd))

    def close(self) -> None:
        """Release (removing the file) and close.

        A run that gave the lock up (refused elsewhere, or --lock fail) takes it once more
        without waiting: if nobody holds it, the file it may have made is removed; if another
        run holds it, it stays theirs.
        """
        if self.fd >= 0 and not self.held:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass
            else:
                self.held = True
        self.release(remove=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
