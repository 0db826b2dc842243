"""Ending the whole job from one rank: ``MPI_Abort``, then this process's own exit if that did not end it.

Every path that ends the job alone comes here (:func:`end_job`): a peer named stopped by the
pulse's watcher (:mod:`azcp_cluster.run.liveness`), a signal outside any stage and an error no
stage agreed on (the CLI). ``MPI_Abort`` is what ends every rank, but it may never return and
never end anything: under MPICH over libfabric's tcp provider, aborting a communicator other
than the world sends to every rank of it and waits, and a stopped rank never takes its part,
so the caller spun inside ``PMPI_Abort`` for ever (4 and 8 hosts in the cluster box, a rank
stopped with SIGSTOP: still there 150 s later). mpi4py's ``Comm.Abort`` also keeps the
interpreter's lock through the call, so no Python thread can run meanwhile, a timer's
neither.

So the deadline is armed before the abort, in C: a POSIX timer whose expiry runs the C
library's ``_exit`` with the documented code on a thread of its own (``timer_create`` with
``SIGEV_THREAD``), needing neither the interpreter's lock nor anything MPI holds. Where such
a timer cannot be made (no ``timer_create`` in the C library), a daemon thread calls
:func:`os._exit` instead, which needs the lock to be free at some point.

What a rank's own exit ends (cluster box, measured): Open MPI's ``mpirun`` ends the whole job
when a rank leaves with a non-zero code without ``MPI_Finalize`` (a stopped rank too, in about
1 s, exit 10); MPICH's hydra does so among the ranks of one host only: across hosts the other
ranks ran on, so there the rank after it names it (its pulse has stopped) and ends the job
with an abort of the world, which hydra does carry to every host (``--peer-timeout`` later).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

# Seconds MPI_Abort gets to end the job before this process ends itself. A working abort ends
# every rank well within it (docs/benchmarks.md); a hung one must not hold the nodes much
# longer than the watcher's --peer-timeout already has. Short enough that a job ends within
# --peer-timeout + 10 s even when the launcher then takes a few seconds to reap the rest.
ABORT_GRACE = 3.0

_SIGEV_THREAD = 2  # <signal.h>: notify by running a function on a new thread
_CLOCK_MONOTONIC = 1  # <time.h>


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _SigevThread(ctypes.Structure):
    _fields_ = [("function", ctypes.c_void_p), ("attribute", ctypes.c_void_p)]


class _SigevUnion(ctypes.Union):
    # The kernel's and the C library's struct sigevent are 64 bytes: value, signo, notify, then this.
    _fields_ = [
        ("pad", ctypes.c_int * ((64 - ctypes.sizeof(ctypes.c_void_p) - 2 * ctypes.sizeof(ctypes.c_int)) // 4)),
        ("thread", _SigevThread),
    ]


class _Sigevent(ctypes.Structure):
    _fields_ = [
        ("value", ctypes.c_void_p),  # union sigval, set through its pointer member: the whole register
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("un", _SigevUnion),
    ]


def _libc() -> Any:
    """The C library already loaded into this process (with ``timer_create`` there or in librt)."""
    return ctypes.CDLL(None, use_errno=True)


def exit_timer(seconds: float, code: int) -> bool:
    """Arm a one-shot POSIX timer that runs the C library's ``_exit(code)`` after ``seconds``.

    Its expiry runs on a thread the C library starts (``SIGEV_THREAD``): no Python, no lock of
    the interpreter's or of MPI's. The handler's one argument, a ``union sigval`` (pointer
    sized, passed in a register), is set to ``code`` through its pointer member, so the
    ``int`` that ``_exit`` reads from that register is the code on every byte order. Returns
    whether the timer is armed (False: no ``timer_create``; the caller falls back).
    """
    libc = _libc()
    create = getattr(libc, "timer_create", None)
    settime = getattr(libc, "timer_settime", None)
    if create is None or settime is None:  # glibc before 2.34 keeps them in librt
        found = ctypes.util.find_library("rt")
        if found is None:
            return False
        rt = ctypes.CDLL(found, use_errno=True)
        create, settime = rt.timer_create, rt.timer_settime
    event = _Sigevent()
    event.notify = _SIGEV_THREAD
    event.value = code
    event.un.thread.function = ctypes.cast(libc._exit, ctypes.c_void_p).value
    timer = ctypes.c_void_p()
    if create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        return False
    whole = int(seconds)
    when = _Itimerspec(_Timespec(0, 0), _Timespec(whole, int((seconds - whole) * 1e9)))
    return bool(settime(timer, 0, ctypes.byref(when), None) == 0)


def arm_deadline(seconds: float, code: int) -> None:
    """End this process with ``code`` after ``seconds``, whatever its threads are doing.

    The C timer when the C library has one (:func:`exit_timer`); otherwise a daemon thread
    that calls :func:`os._exit`.
    """
    if not exit_timer(seconds, code):
        timer = threading.Timer(seconds, os._exit, (code,))
        timer.daemon = True
        timer.start()


def say(line: str) -> None:
    """``line`` on stderr in one write; stdout and stderr flushed (``_exit`` flushes nothing)."""
    for stream, text in ((sys.stdout, ""), (sys.stderr, line + "\n" if line else "")):
        with contextlib.suppress(OSError, ValueError):
            if text:
                stream.write(text)
            stream.flush()


def end_job(
    abort: Callable[[int], object],
    code: int,
    line: str = "",
    *,
    grace: float = ABORT_GRACE,
    arm: Callable[[float, int], None] = arm_deadline,
    leave: Callable[[int], object] = os._exit,
) -> NoReturn:
    """End the whole job with exit ``code``: say ``line``, call ``abort(code)``, and if this
    process is still here ``grace`` seconds later (or the abort returned or raised), end it
    with ``code`` (``os._exit``), after which the launcher ends the other ranks.

    The one way every path ends the job alone (a stopped peer, a signal outside any stage, an
    error on one rank): ``abort`` is the run's communicator's ``Abort`` there. The deadline is
    armed before the abort is called, since mpi4py's ``Abort`` holds the interpreter's lock
    and may never return (see the module). ``arm`` and ``leave`` are for the tests: what arms
    the deadline and what ends the process when the abort came back.
    """
    say(line)
    arm(grace, code)
    with contextlib.suppress(BaseException):  # ending anyway: the one line is said
        abort(code)
    say("")
    leave(code)
    raise SystemExit(code)  # only where ``leave`` returned (a test's)


__all__ = ["ABORT_GRACE", "arm_deadline", "end_job", "exit_timer", "say"]
