"""The command line's entry point: signals from the first instruction, MPI's start and end, exit codes.

This module is the one place where an error becomes an exit status and a printed line. The
options themselves are :mod:`azcp_cluster.options`.

A SIGINT or SIGTERM can come at any instant of the process's life: from a person's Ctrl-C
passed on by ``mpiexec``, from Slurm at a time limit, from Kubernetes stopping a pod. So
:func:`main` installs the recorder (:class:`azcp_cluster.run.interrupts.Interrupts`) before it
imports anything heavy, and it stays until the process exits. MPI's start and end are the
two places where a signal must not even be recorded mid-call: its own threads and state are
half made there, so both run with SIGINT and SIGTERM blocked (:func:`azcp_cluster.run.mpi.signals_deferred`), and
a signal that came meanwhile is delivered, and recorded, right after. The interpreter's own
start-up comes before any line of this module: the ``azcp-cluster`` command
(``bin/azcp-cluster``) starts it with both signals blocked, and the recorder lets them in
(see ``docs/reliability.md``, "Signals").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

TYPE_CHECKING = False  # typing's own costs an import before the handlers are in (mypy reads it as True)
if TYPE_CHECKING:
    from collections.abc import Sequence

    from azcp_cluster.core.comm import Comm
    from azcp_cluster.run.interrupts import Interrupts
    from azcp_cluster.run.mpi import MpiRuntime


def main(argv: Sequence[str] | None = None, *, keep_handlers: bool = False) -> int:
    """Entry point of ``azcp-cluster``: returns the process exit code.

    From its first line to its return, SIGINT and SIGTERM are recorded and become the run's
    agreed outcome (130 / 143, or 0 once the copy is complete). When this call started MPI it
    also ends it (every rank does, with the signals deferred), so the run is over when it
    returns. ``keep_handlers`` leaves the recorder installed (the command does, up to the
    process's exit); otherwise the handlers from before are put back, for a host program.
    """
    _reopen_closed_streams()
    from azcp_cluster.run.interrupts import Interrupts

    interrupts = Interrupts()
    interrupts.install()
    from azcp_cluster.run.mpi import MpiRuntime

    mpi = MpiRuntime()
    try:
        return _main(argv, interrupts, mpi)
    finally:
        mpi.end()
        if not keep_handlers:
            interrupts.restore()


def _reopen_closed_streams() -> None:
    """Treat a standard stream closed at start-up (fd 0, 1 or 2) as /dev/null.

    cron and daemon wrappers may start a process with one closed (``2>&-``). Python then sets
    ``sys.stdin`` / ``sys.stdout`` / ``sys.stderr`` to None, and the first write to it (a
    progress line, an error's line, the final flush) raised AttributeError: an "internal error"
    over a copy left under temporary names, or exit 1 over a complete one. And the next file
    the process opened would take the free number: a print, or MPI's own messages on fd 2,
    would then write into a destination file. So the free numbers are taken at once, by
    /dev/null, and Python gets a stream on each. ``bin/azcp-cluster`` does the same before the
    interpreter starts; this covers ``python -m azcp_cluster`` and a host program's :func:`main`.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            # The lowest free number: this one, as the lower ones are open by now. Inheritable,
            # so that the download workers (started with stdout and stderr inherited) get it too.
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)
    # Kept to the process's end, as Python's own are; closefd=False: the number stays taken.
    if sys.stdin is None:
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    if sys.stdout is None:
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    if sys.stderr is None:
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115


def command() -> int:
    """The ``azcp-cluster`` executable: :func:`main` with the recorder kept to the process's end; its exit code.

    Once the run's outcome is decided, SIGINT and SIGTERM are ignored to the process's end: the
    interpreter's shutdown puts the default actions back before the C library's exit, where
    MPICH tells its launcher that the rank is done, and a late Ctrl-C there would kill the rank
    over a finished copy ("BAD TERMINATION", signal 2). The output is flushed here, where a reader
    that went away (``| head``, a dead ``tee``) loses the rest and nothing more.
    """
    code = main(keep_handlers=True)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    _flush_streams()
    return code


def _flush_streams() -> None:
    """Flush stdout and stderr; one whose reader went away is pointed at /dev/null.

    Otherwise the interpreter's own flush at exit fails again and turns the exit code into 120.
    """

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            with contextlib.suppress(OSError, ValueError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, stream.fileno())
                os.close(null)


def _main(argv: Sequence[str] | None, interrupts: Interrupts, mpi: MpiRuntime) -> int:
    from azcp_cluster.core.errors import AzcpError, ReportPathError, UsageError
    from azcp_cluster.run.mpi import launcher_mismatch, launcher_rank, library_version

    comm: Comm | None = None
    try:
        from azcp_cluster import options

        try:
            cfg = options.config_from_args(argv)
        except UsageError as exc:
            # Every rank parses the same arguments; print once (rank 0, or a plain process).
            if launcher_rank() == 0:
                _say(exc.one_line())
                json_path = options.json_path_of(argv)
                if json_path and not isinstance(exc, ReportPathError):
                    from azcp_cluster.run.report import Report, write_json_report

                    write_json_report(Report(exit_code=exc.exit_code, error=exc.one_line()), json_path)
            else:
                _let_rank_0_speak()
            return exc.exit_code
        from azcp_cluster.run.rails import bind_before_mpi

        bind_before_mpi(cfg.rails)  # what MPI reads when it starts: this rank's fabric NIC (--rails)
        comm = mpi.comm()
        mismatch = launcher_mismatch(os.environ, comm.Get_size(), library_version)
        if mismatch is not None:
            # Every task is rank 0 of a world of its own: the launcher's rank 0 speaks.
            if launcher_rank() != 0:
                _let_rank_0_speak()
            else:
                _say(mismatch.one_line())
                if cfg.json_path:
                    from azcp_cluster.run.report import Report, write_json_report

                    write_json_report(
                        Report(ranks=1, exit_code=mismatch.exit_code, error=mismatch.one_line()), cfg.json_path
                    )
            return mismatch.exit_code
        from azcp_cluster.pipeline import run

        try:
            run(cfg, comm, interrupts=interrupts)  # it writes the JSON report (rank 0)
        except AzcpError as exc:
            # The error was agreed by all ranks (a signal's too): every rank exits with its
            # code, rank 0 speaks.
            if comm.Get_rank() == 0:
                _say(exc.one_line())
            return exc.exit_code
        return 0  # a signal after the last agreement does not undo a finished copy
    except BaseException as exc:
        return _unexpected(exc, comm, interrupts)


def _unexpected(exc: BaseException, comm: Comm | None, interrupts: Interrupts) -> int:
    """What no stage agreed on: a signal outside any stage, or a bug. Ends the whole job
    (:func:`azcp_cluster.run.ending.end_job`: ``MPI_Abort``, then this process's own exit if
    the abort has not ended it), or returns the exit code where no other rank waits."""
    from azcp_cluster.core.errors import InternalError, Interrupted, exit_code_for
    from azcp_cluster.run.cluster import redact
    from azcp_cluster.run.ending import end_job
    from azcp_cluster.run.interrupts import signal_error
    from azcp_cluster.run.mpi import launcher_rank

    rank = None if comm is None else comm.Get_rank()
    if isinstance(exc, KeyboardInterrupt | Interrupted):
        # A signal outside any stage under a host program's default handler: not a bug.
        # Nothing to agree before MPI is up or alone; otherwise the others may be waiting in
        # a collective, so end the job, with the signal's code.
        stop = exc if isinstance(exc, Interrupted) else interrupts.error(rank) or signal_error(signal.SIGINT, rank)
        if comm is not None and comm.Get_size() > 1:
            end_job(comm.Abort, stop.exit_code, stop.one_line())
        if comm is not None or launcher_rank() == 0:
            _say(stop.one_line())
        return stop.exit_code
    if comm is None:
        raise exc  # a bug before MPI is up: no other rank waits on this one
    # Not agreed (a bug): the others may be waiting in a collective, so end the whole
    # job rather than hang (alone too: the rank's one line and exit code, at once).
    error = InternalError(f"unexpected {type(exc).__name__}: {redact(str(exc))}", rank=rank)
    end_job(comm.Abort, exit_code_for(error), error.one_line())


# How long a rank other than 0 waits before it leaves with an error only rank 0 says: Open MPI's
# launcher ends the whole job as soon as one rank exits non-zero, and took rank 0 with it before
# it had printed the line (seen in the Open MPI suite, an option refused before MPI starts).
SPEAK_GRACE = 1.5


def _let_rank_0_speak() -> None:
    """Wait :data:`SPEAK_GRACE` seconds (a rank other than 0, leaving with rank 0's error) under a
    launcher that ends the job at a rank's non-zero exit: Open MPI's, and Slurm's (srun with
    KillOnBadExit). MPICH's waits for every rank anyway: no wait there."""
    import time

    if "OMPI_COMM_WORLD_RANK" in os.environ or "SLURM_PROCID" in os.environ:
        time.sleep(SPEAK_GRACE)


def _say(line: str) -> None:
    """One line on stderr, flushed; a closed stderr loses it, nothing more."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(line + "\n")  # one write (report.say: lines of two ranks never run together)
        sys.stderr.flush()
