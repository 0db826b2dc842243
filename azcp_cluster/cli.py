"""The command line's entry point: signals from the first instruction, MPI's start and end, exit codes.

This module is the one place where an error becomes an exit status and a printed line. The
options themselves are :mod:`azcp_cluster.options`.

A SIGINT or SIGTERM can come at any instant of the process's life: from a person's Ctrl-C
passed on by ``mpiexec``, from Slurm at a time limit, from Kubernetes stopping a pod. So
:func:`main` installs the recorder (:class:`azcp_cluster.run.interrupts.Interrupts`) before it
imports anything heavy, and it stays until the process exits. MPI's start and end are the
two places where a signal must not even be recorded mid-call: its own threads and state are
half made there, so both run with SIGINT and SIGTERM blocked (:func:`_signals_deferred`), and
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
    from collections.abc import Callable, Iterator, Mapping, Sequence
    from typing import Any

    from azcp_cluster.core.errors import TopologyError
    from azcp_cluster.run.interrupts import Interrupts


def main(argv: Sequence[str] | None = None, *, keep_handlers: bool = False) -> int:
    """Entry point of ``azcp-cluster``: returns the process exit code.

    From its first line to its return, SIGINT and SIGTERM are recorded and become the run's
    agreed outcome (130 / 143, or 0 once the copy is complete). When this call started MPI it
    also ends it (every rank does, with the signals deferred), so the run is over when it
    returns. ``keep_handlers`` leaves the recorder installed (the command does, up to the
    process's exit); otherwise the handlers from before are put back, for a host program.
    """
    from azcp_cluster.run.interrupts import Interrupts

    interrupts = Interrupts()
    interrupts.install()
    mpi = _Runtime()
    try:
        return _main(argv, interrupts, mpi)
    finally:
        mpi.end()
        if not keep_handlers:
            interrupts.restore()


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


class _Runtime:
    """MPI's start and end for the command, each with SIGINT and SIGTERM deferred.

    mpi4py starts MPI when ``mpi4py.MPI`` is first imported and ends it at the interpreter's
    exit; the command does both itself, so that both happen while its recorder is installed.
    Only an MPI this object started is ended by it: a host program that imported mpi4py
    before keeps its own.
    """

    def __init__(self) -> None:
        self.started = False

    def comm(self) -> Any:
        """``MPI.COMM_WORLD``, starting MPI if no one has (signals deferred meanwhile)."""
        started_before = "mpi4py.MPI" in sys.modules
        with _signals_deferred():
            from mpi4py import MPI
        self.started = not started_before and bool(MPI.Is_initialized())
        return MPI.COMM_WORLD

    def end(self) -> None:
        """End MPI if :meth:`comm` started it (signals deferred meanwhile).

        The process must then leave through the C library's ``exit`` (Python's normal exit
        does): MPICH tells its ``mpiexec`` that a rank is done from an ``atexit`` hook, and
        ``mpiexec`` kills every other rank with SIGKILL when one leaves without it
        (``os._exit``), whatever its exit code.
        """
        if not self.started:
            return
        self.started = False
        from mpi4py import MPI

        with _signals_deferred():
            if not MPI.Is_finalized():
                MPI.Finalize()


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread for the block's duration; one that came is delivered after.

    Threads that MPI starts inside inherit the blocked mask, so the kernel delivers the
    signals to the main thread, where the recorder runs, and never into MPI's own threads.
    """
    before = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _main(argv: Sequence[str] | None, interrupts: Interrupts, mpi: _Runtime) -> int:
    from azcp_cluster.core.errors import AzcpError, ReportPathError, UsageError

    comm: Any = None
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
            return exc.exit_code
        comm = mpi.comm()
        mismatch = launcher_mismatch(os.environ, comm.Get_size(), _mpi_library)
        if mismatch is not None:
            # Every task is rank 0 of a world of its own: the launcher's rank 0 speaks.
            if launcher_rank() == 0:
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


def _unexpected(exc: BaseException, comm: Any, interrupts: Interrupts) -> int:
    """What no stage agreed on: a signal outside any stage, or a bug. Ends the whole job."""
    from azcp_cluster.core.errors import InternalError, Interrupted, exit_code_for
    from azcp_cluster.run.cluster import redact
    from azcp_cluster.run.interrupts import signal_error

    rank = None if comm is None else comm.Get_rank()
    if isinstance(exc, KeyboardInterrupt | Interrupted):
        # A signal outside any stage under a host program's default handler: not a bug.
        # Nothing to agree before MPI is up or alone; otherwise the others may be waiting in
        # a collective, so end the job, with the signal's code.
        stop = exc if isinstance(exc, Interrupted) else interrupts.error(rank) or signal_error(signal.SIGINT, rank)
        if comm is not None or launcher_rank() == 0:
            _say(stop.one_line())
        if comm is not None and comm.Get_size() > 1:
            comm.Abort(stop.exit_code)
        return stop.exit_code
    if comm is None:
        raise exc  # a bug before MPI is up: no other rank waits on this one
    # Not agreed (a bug): the others may be waiting in a collective, so end the whole
    # job rather than hang.
    error = InternalError(f"unexpected {type(exc).__name__}: {redact(str(exc))}", rank=rank)
    _say(error.one_line())
    comm.Abort(exit_code_for(error))
    return exit_code_for(error)


def _say(line: str) -> None:
    """One line on stderr, flushed; a closed stderr loses it, nothing more."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(line + "\n")  # one write (report.say: lines of two ranks never run together)
        sys.stderr.flush()


def launcher_rank() -> int:
    """This process's rank as the launcher set it (hydra, PMIx, Open MPI, Slurm), without initialising MPI."""
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 0


# What each launcher sets in every task it starts: the number of tasks, and who set it. Only a
# job step's own variables count: a batch script of a many-task allocation has SLURM_NTASKS
# too, and a plain `python` there is one process, rightly a world of one.
_LAUNCHED_TASKS = (
    ("SLURM_STEP_NUM_TASKS", "srun"),  # set by srun in each task of the step (with SLURM_STEP_ID)
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "a PMI launcher (MPICH's or Intel MPI's mpiexec, srun --mpi=pmi2)"),
)


def launched_tasks(env: Mapping[str, str]) -> tuple[int, str, str] | None:
    """How many tasks the launcher says it started, the variable that says so and the launcher.

    None when no launcher's variable says more than one (a plain process, ``srun -n 1``).
    """
    for var, launcher in _LAUNCHED_TASKS:
        if var == "SLURM_STEP_NUM_TASKS" and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
            continue
        value = env.get(var, "").strip()
        if value.isascii() and value.isdigit() and int(value) > 1:
            return int(value), var, launcher
    return None


def launcher_mismatch(env: Mapping[str, str], world: int, library: Callable[[], str]) -> TopologyError | None:
    """The error when the launcher started several tasks but MPI's world has one rank; else None.

    Each task is then a one-rank job of its own (``srun`` with an ``--mpi`` plugin this MPI
    does not speak, or the ``mpiexec`` of another MPI): each would copy the whole dataset
    alone and exit 0, the cost the tool exists to avoid. ``library``: the MPI mpi4py uses.
    """
    from azcp_cluster.core.errors import TopologyError

    launched = launched_tasks(env)
    if world != 1 or launched is None:
        return None
    tasks, var, launcher = launched
    if var == "SLURM_STEP_NUM_TASKS":
        fix = "run srun with the PMI plugin of that MPI, e.g. srun --mpi=pmix or --mpi=pmi2"
        fix += " (srun --mpi=list shows them)"
    else:
        fix = "launch it with the mpiexec of that MPI"
    return TopologyError(
        f"{launcher} started {tasks} tasks ({var}={tasks}) but MPI's world has 1 rank: each task is a "
        f"one-rank job of its own and would copy everything alone; mpi4py uses {library()}: {fix}"
    )


def _mpi_library() -> str:
    """The first line of the MPI library's version (the MPI mpi4py was built against)."""
    from mpi4py import MPI

    try:
        text = MPI.Get_library_version()
    except Exception:  # an MPI without MPI_Get_library_version: named by mpi4py's build instead
        return "an unknown MPI library"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return " ".join(first.split()) or "an unknown MPI library"
