"""The one exception tree of the project, and the one place that maps it to exit codes.

Every failure the tool reports is an :class:`AzcpError`. Its class decides the exit
code (``EXIT_CODES`` below is the documented table); its message is a single line
that names the rank, the file and the cause where they are known.
"""

from __future__ import annotations

EXIT_OK = 0


def printable(text: str) -> str:
    """``text`` with line breaks, tabs, other control characters and undecodable bytes escaped
    (``\\n``, ``\\udcff``): a name may hold any of them, and a line shown or parsed must stay one
    line with its columns (a file named ``x\\n[dry-run] 0 files`` forges no line)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class AzcpError(Exception):
    """Base of every error the tool reports to its user."""

    exit_code = 1
    stage = "internal"

    def __init__(self, message: str, *, path: str | None = None, rank: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.rank = rank

    def one_line(self) -> str:
        """The single line shown to the user: rank, file and cause."""
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.path is not None:
            parts.append(f"'{printable(self.path)}'")
        parts.append(" ".join(self.message.split()))
        return f"azcp-cluster: error [{self.stage}]: " + ": ".join(parts)


class InternalError(AzcpError):
    """A bug or an unexpected condition (exit 1)."""

    exit_code = 1
    stage = "internal"


class UsageError(AzcpError):
    """Bad arguments or options (exit 2)."""

    exit_code = 2
    stage = "arguments"


class ReportPathError(UsageError):
    """``--json`` or ``--log-file`` names a place it must not go (inside DEST): refused, and no report
    or log written (exit 2)."""

    exit_code = 2
    stage = "arguments"


class CredentialError(UsageError):
    """A credential that cannot be used or yields no token, e.g. an unusable azure-identity source (exit 2).

    A token that the service *rejects* is reported by the stage that used it (list: 3,
    download: 5), like a wrong key or SAS.
    """

    exit_code = 2
    stage = "credentials"


class TopologyError(AzcpError):
    """Ranks laid out in a way the run cannot use, e.g. a --source-rank that cannot see SOURCE (exit 2)."""

    exit_code = 2
    stage = "topology"


class ListError(AzcpError):
    """The source could not be listed, or its listing is unusable (exit 3)."""

    exit_code = 3
    stage = "list"


class DiffError(AzcpError):
    """The local copies could not be compared with the listing (exit 4)."""

    exit_code = 4
    stage = "diff"


class DownloadError(AzcpError):
    """A download failed for good (exit 5)."""

    exit_code = 5
    stage = "download"


class BroadcastError(AzcpError):
    """The broadcast stage failed (exit 6)."""

    exit_code = 6
    stage = "bcast"


class VerifyError(AzcpError):
    """Copies differ from each other or from the source (exit 7)."""

    exit_code = 7
    stage = "verify"


class SourceError(DownloadError):
    """A local SOURCE could not be read, or changed while it was read (exit 5, like a download)."""

    exit_code = 5
    stage = "source"


class LocalFSError(AzcpError):
    """The destination filesystem refused an operation (exit 8)."""

    exit_code = 8
    stage = "local"


class LockError(AzcpError):
    """DEST is held by another run: ``--lock fail``, or ``--lock-timeout`` passed (exit 9)."""

    exit_code = 9
    stage = "lock"


class PeerStoppedError(AzcpError):
    """A rank sent no pulse for ``--peer-timeout`` seconds (stopped, frozen, cut off): the job is ended (exit 10)."""

    exit_code = 10
    stage = "peer"
    # Seen by a rank whose rank before was already ending the job for a rank it named: this
    # rank ends quietly, so the job says one line (the first watcher's), not one per watcher.
    quiet = False


class Interrupted(AzcpError):
    """The run was stopped by a signal; the exit code is the shell's 128 + signal number."""

    exit_code = 130
    stage = "interrupted"
    signal_name = "SIGINT"


class SigintError(Interrupted):
    """SIGINT (a person's Ctrl-C, or ``mpiexec`` passing it on): exit 130."""

    exit_code = 130
    signal_name = "SIGINT"


class SigtermError(Interrupted):
    """SIGTERM (Slurm at a time limit or ``scancel``, Kubernetes stopping a pod): exit 143."""

    exit_code = 143
    signal_name = "SIGTERM"


ERROR_CLASSES: dict[str, type[AzcpError]] = {
    cls.__name__: cls
    for cls in (
        InternalError,
        UsageError,
        ReportPathError,
        CredentialError,
        TopologyError,
        ListError,
        DiffError,
        DownloadError,
        BroadcastError,
        VerifyError,
        SourceError,
        LocalFSError,
        LockError,
        PeerStoppedError,
        SigintError,
        SigtermError,
    )
}

EXIT_CODES: dict[int, str] = {
    0: "success (also when nothing needed copying)",
    1: "internal error",
    2: "bad arguments, credentials or topology",
    3: "listing the source failed",
    4: "comparing local copies failed",
    5: "download failed, or a local SOURCE could not be read or changed while it was read",
    6: "broadcast failed",
    7: "verification failed",
    8: "local filesystem error (mkdir, write, rename, space, a link or special file in DEST)",
    9: "DEST is in use by another run (--lock fail, or --lock-timeout passed)",
    10: "a rank stopped answering (no pulse for --peer-timeout seconds): the job was ended",
    130: "interrupted by SIGINT",
    143: "terminated by SIGTERM",
}


def exit_code_for(error: BaseException) -> int:
    """Map any exception to the documented exit code (1 for anything unexpected)."""
    if isinstance(error, AzcpError):
        return error.exit_code
    return InternalError.exit_code
