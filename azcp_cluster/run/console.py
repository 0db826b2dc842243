"""What the run prints and where: the one place that decides what each verbosity level shows.

Every rank says its warnings and notices on stderr (:func:`say`; its log file has them too).
Rank 0 also prints the report's stage lines and the summary line on stdout (the stable lines
scripts parse, and ``--json`` for the rest) and the progress on stderr. :class:`Console` decides
which of them reach the terminal (:data:`SHOWN`, by ``-q`` / ``-v``), and copies every one of
them to ``--log-file`` whatever the level, with the libraries' log records (azure-identity's,
azure-core's) at INFO and up, which reach the terminal only with ``-v`` (their own warnings,
such as ``ImdsCredential.get_token failed``, leaked onto it through :mod:`logging`'s last-resort
handler).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import stat
import sys
import threading
from collections.abc import Iterable
from typing import TextIO

# What each level shows on the terminal: "report" (the stage lines), "progress", "note" (a
# one-line notice of rank 0's, such as a --progress bar that prints lines), "summary" (the
# last line), "library" (the libraries' log records), "detail" (what -v adds: the credential
# chosen). Errors and warnings always show.
SHOWN = {
    "quiet": frozenset({"summary"}),
    "normal": frozenset({"report", "progress", "note", "summary"}),
    "verbose": frozenset({"report", "progress", "note", "summary", "library", "detail"}),
}
# The loggers of the libraries the run calls (their records go through the console).
LIBRARY_LOGGERS = ("azure", "msal", "urllib3")


# The consoles of the runs in progress in this process (one, but for a host program's threads):
# a warning said anywhere reaches their log files too.
_ACTIVE: list[Console] = []


def say(line: str) -> None:
    """``line`` on stderr in one write, flushed (a closed stderr loses it, nothing more), and in
    the log file of the run in progress, if it has one.

    One write: under ``PYTHONUNBUFFERED`` print() writes the text and its newline apart, and
    two ranks' lines on one launcher's stderr then run together on one line."""
    _stderr(line)
    for console in tuple(_ACTIVE):
        console.log([line])


def notice(line: str) -> None:
    """A notice of any rank's (a retry's): on stderr unless the run in progress is quiet
    (``-q``: errors, warnings and the summary only), and in its log file."""
    if not any(console.verbosity == "quiet" for console in tuple(_ACTIVE)):
        _stderr(line)
    for console in tuple(_ACTIVE):
        console.log([line])


def _stderr(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class Console:
    """One rank's output: the terminal's share by verbosity (:data:`SHOWN`) and every line in
    the log file (opened by :meth:`open_log` once the run knows it lies outside DEST; the lines
    before wait in memory). :meth:`close` ends it and takes its log handler off the libraries'
    loggers. Safe from several threads (the libraries log on their own)."""

    def __init__(self, verbosity: str, log_path: str | None, out: TextIO, rank: int) -> None:
        self.verbosity = verbosity
        self.log_path = log_path
        self.out = out
        self.rank = rank
        self._lock = threading.Lock()
        self._pending: list[str] | None = [] if log_path else None  # lines before the log opens
        self._log: TextIO | None = None
        self._handler = _LibraryHandler(self)
        self._levels: dict[str, int] = {}
        for name in LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            if (log_path or verbosity == "verbose") and not logger.isEnabledFor(logging.INFO):
                logger.setLevel(logging.INFO)
            # A handler of ours, even one that shows nothing, keeps the last-resort handler
            # from printing their warnings; a host program's own handlers still get them.
            logger.addHandler(self._handler)
        _ACTIVE.append(self)

    def shows(self, kind: str) -> bool:
        """Whether ``kind`` of output (:data:`SHOWN`) reaches the terminal at this level."""
        return kind in SHOWN[self.verbosity]

    def progress_mode(self, mode: str) -> str:
        """The progress mode this level allows (``none`` under ``-q``)."""
        return mode if self.shows("progress") else "none"

    def report(self, lines: Iterable[str], kind: str = "report", logged: bool = False) -> None:
        """Rank 0's stdout lines (the stage lines, or the summary: ``kind``) in one write if this
        level shows them; in the log file always (``logged``: they are there already). A reader
        gone loses them, nothing more."""
        lines = list(lines)
        if not lines:
            return
        if self.shows(kind):
            with contextlib.suppress(OSError, ValueError):
                self.out.write("".join(f"{line}\n" for line in lines))
                self.out.flush()
        if not logged:
            self.log(lines)

    def note(self, line: str, kind: str = "note") -> None:
        """A line on stderr if this level shows ``kind`` (errors: always); in the log file always."""
        if kind == "error" or self.shows(kind):
            _stderr(line)
        self.log([line])

    def log(self, lines: Iterable[str]) -> None:
        """``lines`` in the log file (kept in memory until it opens); nothing without one."""
        with self._lock:
            if self._pending is not None:
                self._pending.extend(lines)
            elif self._log is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._log.write("".join(f"{line}\n" for line in lines))
                    self._log.flush()

    def open_log(self, dest: str) -> None:
        """Open the log file (appending: a job's reruns follow one another) and write what
        waited; one that cannot be opened is a warning, as an unwritable ``--json`` is. Never
        one inside ``dest`` (DEST's real path: setup refuses it, exit 2)."""
        from azcp_cluster.core.config import json_inside_dest

        with self._lock:
            if self._pending is None or self.log_path is None:
                return
            pending, self._pending = self._pending, None
            if json_inside_dest(os.path.realpath(self.log_path), dest):
                return
            try:
                self._log = open_log_file(self.log_path)
            except OSError as exc:
                _stderr(f"azcp-cluster: warning: cannot write the log to {self.log_path}: {exc.strerror}")
                return
        self.log([self._header(), *pending])

    def _header(self) -> str:
        """The first line a run writes to its log: appended runs told apart by their start (UTC),
        the version and the rank (a rank other than 0 logs its own warnings and errors only)."""
        from azcp_cluster import __version__

        began = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"# azcp-cluster {__version__}, rank {self.rank}, log opened {began} (pid {os.getpid()})"

    def refuse_log(self) -> None:
        """Never open the log file (setup refused its path: exit 2); its waiting lines dropped."""
        with self._lock:
            self._pending = None

    def close(self, dest: str) -> None:
        """The libraries' loggers as they were, and the log file closed (opened first if it was
        not yet, outside ``dest``, for the lines of a run that ended before it could be)."""
        with contextlib.suppress(ValueError):
            _ACTIVE.remove(self)
        for name in LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            logger.removeHandler(self._handler)
            logger.setLevel(self._levels.get(name, logging.NOTSET))
        self.open_log(dest)
        with self._lock:
            self._pending = None
            if self._log is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._log.close()
                self._log = None


def open_log_file(path: str) -> TextIO:
    """``path`` opened to append, made if missing; never through a symbolic link (a shared
    ``/tmp`` may hold one planted at the name), never anything but a regular file (a FIFO would
    block the run in ``open``, deaf to signals): an OSError naming why otherwise."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(exc.errno, "it is a symbolic link (never followed); name the file itself") from None
        if exc.errno == errno.ENXIO:
            raise OSError(exc.errno, "it is a FIFO or a socket, not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file")
        os.set_blocking(fd, True)
        return open(fd, "a", encoding="utf-8", errors="backslashreplace", closefd=True)
    except BaseException:
        os.close(fd)
        raise


class _LibraryHandler(logging.Handler):
    """A library's log record, as one line: on stderr under ``-v``, in the log file always."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        """One line, ``azcp-cluster: rank R: LEVEL logger: message`` (its first line only)."""
        try:
            text = record.getMessage().splitlines()[0] if record.getMessage() else ""
        except Exception:  # a library's bad format string: not the copy's failure
            text = str(record.msg)
        line = f"azcp-cluster: rank {self.console.rank}: {record.levelname.lower()} {record.name}: {text}"
        self.console.note(line, "library")
