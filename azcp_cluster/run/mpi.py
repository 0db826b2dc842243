"""MPI's start and end, and what the launcher says: the one place (with the fan-out's transport)
that imports mpi4py.

mpi4py starts MPI when ``mpi4py.MPI`` is first imported and ends it at the interpreter's exit;
the command does both itself, with SIGINT and SIGTERM blocked (:func:`signals_deferred`): MPI's
own threads and state are half made there. The launcher's variables say this process's rank
before MPI is up (for the one line of an error that comes first) and how many tasks it started
(a world of one among several tasks is the wrong ``srun --mpi`` or another MPI's ``mpiexec``).
Only the standard library at the top: the entry point imports this module before anything heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import cast

from azcp_cluster.core.comm import Comm
from azcp_cluster.core.errors import TopologyError


def world() -> Comm:
    """``MPI.COMM_WORLD`` (mpi4py starts MPI if no one has): the Python API's default communicator."""
    from mpi4py import MPI

    return cast(Comm, MPI.COMM_WORLD)


def threads_allowed() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (a second thread may make MPI calls)."""
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


class MpiRuntime:
    """MPI's start and end for the command, each with SIGINT and SIGTERM deferred.

    mpi4py starts MPI when ``mpi4py.MPI`` is first imported and ends it at the interpreter's
    exit; the command does both itself, so that both happen while its recorder is installed.
    Only an MPI this object started is ended by it: a host program that imported mpi4py
    before keeps its own.
    """

    def __init__(self) -> None:
        self.started = False

    def comm(self) -> Comm:
        """``MPI.COMM_WORLD``, starting MPI if no one has (signals deferred meanwhile)."""
        started_before = "mpi4py.MPI" in sys.modules
        with signals_deferred():
            from mpi4py import MPI
        self.started = not started_before and bool(MPI.Is_initialized())
        return cast(Comm, MPI.COMM_WORLD)

    def end(self) -> None:
        """End MPI if :meth:`comm` started it (signals deferred meanwhile).

        The process must then leave through the C library's ``exit`` (Python's normal exit
        does): MPICH tells its ``mpiexec`` that a rank is done from an ``atexit`` hook, and
        ``mpiexec`` kills every other rank with SIGKILL when one leaves without it
        (``os._exit``), whatever its exit code (the ranks of that host: across hosts, hydra
        ends the job on an abort or a rank killed by a signal, not on such an exit).
        """
        if not self.started:
            return
        self.started = False
        from mpi4py import MPI

        with signals_deferred():
            if not MPI.Is_finalized():
                MPI.Finalize()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread for the block's duration; one that came is delivered after.

    Threads that MPI starts inside inherit the blocked mask, so the kernel delivers the
    signals to the main thread, where the recorder runs, and never into MPI's own threads.
    """
    before = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


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


def library_version() -> str:
    """The first line of the MPI library's version (the MPI mpi4py was built against)."""
    from mpi4py import MPI

    try:
        text = MPI.Get_library_version()
    except Exception:  # an MPI without MPI_Get_library_version: named by mpi4py's build instead
        return "an unknown MPI library"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return " ".join(first.split()) or "an unknown MPI library"
