"""The subset of an mpi4py communicator the package uses, as typing protocols.

Everything that talks to other ranks gets a communicator passed in (so a test can hand it a
real one, or one of its own making); these protocols say what it must offer, and let the
type checker follow a communicator through the run instead of an ``Any``. Only the typing
module is imported: mpi4py's own objects fit them (run/mpi.py hands them over).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

T = TypeVar("T")


class Request(Protocol):
    """A non-blocking operation's request (``MPI.Request``)."""

    def Test(self) -> bool:
        """Whether it completed (a completed request is freed)."""

    def Wait(self) -> object:
        """Block until it completed."""

    def Cancel(self) -> None:
        """Ask for it to be cancelled (a receive nobody will match)."""

    def wait(self) -> object:
        """Block until it completed; a pickled receive's object."""

    def test(self) -> tuple[bool, object]:
        """Whether it completed, and a pickled receive's object."""


class Comm(Protocol):
    """A communicator (``MPI.Intracomm``): the calls the run, the pulse and the fan-out make."""

    def Get_rank(self) -> int:
        """This process's rank."""

    def Get_size(self) -> int:
        """How many ranks."""

    def Dup(self) -> Comm:
        """A communicator of the same ranks whose messages never mix with this one's."""

    def Split(self, color: int = 0, key: int = 0) -> Comm:
        """The ranks of the same ``color``, ordered by ``key`` (collective)."""

    def Free(self) -> None:
        """Release it."""

    def Abort(self, errorcode: int = 0) -> None:
        """End every rank of the job (the launcher's part)."""

    def Get_attr(self, keyval: int) -> int | None:
        """An integer attribute (``MPI.TAG_UB``: the largest tag), None if unset."""

    # Pickled objects (small messages of the control plane).
    def bcast(self, obj: T, root: int = 0) -> T:
        """``root``'s object on every rank."""

    def allgather(self, sendobj: T) -> list[T]:
        """Every rank's object, on every rank."""

    def allreduce(self, sendobj: T, op: object = None) -> T:
        """Every rank's object reduced by ``op``, on every rank."""

    def isend(self, obj: object, dest: int, tag: int = 0) -> Request:
        """Start sending an object."""

    def recv(self, buf: None = None, source: int = -1, tag: int = -1) -> object:
        """Receive an object (blocking)."""

    def iprobe(self, source: int = -1, tag: int = -1) -> bool:
        """Whether a message is waiting (never blocks)."""

    # Buffers (the byte path): numpy arrays, or [array, MPI datatype] pairs.
    def Ibarrier(self) -> Request:
        """Start a barrier."""

    def Ibcast(self, buf: object, root: int = 0) -> Request:
        """Start broadcasting ``root``'s buffer."""

    def Iallreduce(self, sendbuf: object, recvbuf: object, op: object = None) -> Request:
        """Start an element-wise reduction of every rank's buffer."""

    def Isend(self, buf: object, dest: int, tag: int = 0) -> Request:
        """Start sending a buffer."""

    def Issend(self, buf: object, dest: int, tag: int = 0) -> Request:
        """Start sending a buffer, complete once the receiver has matched it."""

    def Irecv(self, buf: object, source: int = -1, tag: int = -1) -> Request:
        """Start receiving into a buffer."""
