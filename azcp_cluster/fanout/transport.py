"""The fan-out's link between the node leaders: every call it makes to another rank, behind one small protocol.

The driver (:class:`azcp_cluster.fanout.driver.FanOutDriver`) needs four things of the
ranks it fans out to, and nothing else:

* ``post(data, root, receivers)``: start one transfer. The root's ``data`` goes to each
  receiver's ``data`` (same length); ``receivers`` None: every other rank (one collective
  broadcast). Returns a request, opaque to the driver.
* ``test(request)``: whether it completed (never blocks; the driver polls the oldest).
* ``wait(request)``: until it completed (the ranks are stopping).
* ``agree(failed)``: every rank says whether it failed; whether any did (blocks).

Transfers are matched in the order they are posted (collectives among all ranks, each
sender's transfers to one receiver among themselves), as MPI matches them; an agreement is
a collective too. :class:`MpiTransport` makes them MPI calls on the leaders' communicator
(the only module of the fan-out that imports mpi4py); :class:`LoopbackTransport` runs N
ranks as threads of one process, so tests drive the real driver without ``mpiexec``.

Both are also the wire a chain runs on (:class:`azcp_cluster.fanout.chain.Wire`: tagged
``isend``/``irecv``, ``done``, a non-blocking agreement, ``maximum``): ``--fanout ibcast``
uses them as they are, ``chain`` through :class:`azcp_cluster.fanout.chain.ChainTransport`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from azcp_cluster.core.comm import Comm
from azcp_cluster.core.naps import nap_until
from azcp_cluster.core.schedule import call_slices

# Seconds between looks at an agreement while a rank waits in it, growing while nothing
# completes: a short wait stays short, a long one costs the working ranks no CPU.
AGREE_NAP = 0.0001
MAX_AGREE_NAP = 0.002  # as the driver's MAX_NAP: a waiting rank is late by milliseconds at most

# The tag of point-to-point transfers on the broadcast communicator (collectives never match it).
P2P_TAG = 11

# What ``post`` returns: opaque to the driver, understood by the transport that made it.
Request = Any


class Transport(Protocol):
    """The fan-out's calls to the other ranks (see the module)."""

    @property
    def rank(self) -> int:
        """This rank, among the ranks of the fan-out."""

    @property
    def size(self) -> int:
        """How many ranks take part."""

    def post(self, data: np.ndarray, root: int, receivers: Sequence[int] | None) -> Request:
        """Start sending the root's ``data`` to ``receivers`` (None: every other rank)."""

    def test(self, request: Request) -> bool:
        """Whether ``request`` completed (its ``data`` may be read, or reused)."""

    def wait(self, request: Request) -> None:
        """Block until ``request`` completed."""

    def agree(self, failed: bool, between: Callable[[], None] | None = None) -> bool:
        """Whether any rank failed: every rank calls it at the same point, and all get the same
        answer. ``between`` runs while the rank waits for the others (it must not block): a
        signal that comes meanwhile is told to the others then, not once all have joined."""


class MpiTransport:
    """:class:`Transport` over an MPI communicator (the node leaders'): ``MPI_Ibcast`` for a
    transfer every rank receives, ``Isend``/``Irecv`` for one with fewer receivers, each cut
    into calls below MPI's 2 GiB count; an agreement is an ``allreduce`` of the flags."""

    def __init__(self, comm: Comm) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self._rank: int = comm.Get_rank()
        self._size: int = comm.Get_size()
        # Open MPI (and HPC-X, which is Open MPI) moves the messages in flight to a peer
        # together; MPICH and its kin (Intel MPI, Cray MPICH) in order (core.chain.SendWindow).
        self.interleaves: bool = MPI.get_vendor()[0] == "Open MPI"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def post(self, data: np.ndarray, root: int, receivers: Sequence[int] | None) -> Request:
        pieces = [[data[start:stop], self._mpi.BYTE] for start, stop in call_slices(len(data))]
        if receivers is None:
            return [self.comm.Ibcast(piece, root=root) for piece in pieces]
        if root == self._rank:
            return [self.comm.Isend(piece, dest=to, tag=P2P_TAG) for to in receivers for piece in pieces]
        return [self.comm.Irecv(piece, source=root, tag=P2P_TAG) for piece in pieces]

    def test(self, request: Request) -> bool:
        return bool(self._mpi.Request.Testall(request))

    def wait(self, request: Request) -> None:
        self._mpi.Request.Waitall(request)

    def agree(self, failed: bool, between: Callable[[], None] | None = None) -> bool:
        request = self.iagree(failed)
        nap_until(lambda: self.done(request), AGREE_NAP, MAX_AGREE_NAP, between)
        return self.answer(request)

    # -- the point-to-point wire of a chain (fanout/chain.py) --------------------------------

    @property
    def tag_limit(self) -> int:
        """MPI_TAG_UB of the communicator (at least 32767, by the standard)."""
        limit = self.comm.Get_attr(self._mpi.TAG_UB)
        return int(limit) if limit else 32767

    def isend(self, data: np.ndarray, dest: int, tag: int) -> Request:
        return self.comm.Isend([data, self._mpi.BYTE], dest=dest, tag=tag)

    def irecv(self, data: np.ndarray, source: int, tag: int) -> Request:
        return self.comm.Irecv([data, self._mpi.BYTE], source=source, tag=tag)

    def done(self, request: Request) -> bool:
        return bool(request.Test())

    def iagree(self, failed: bool) -> Request:
        return _MpiAgreement(self.comm, self._mpi, failed)

    def answer(self, request: Request) -> bool:
        return bool(request.result[0])

    def maximum(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self._mpi.MAX))


class _MpiAgreement:
    """A non-blocking agreement: an ``Iallreduce`` (MAX) of the ranks' flags, its buffers kept alive with it."""

    def __init__(self, comm: Comm, mpi: Any, failed: bool) -> None:
        self.flags = np.array([1 if failed else 0], dtype=np.int32)
        self.result = np.zeros(1, dtype=np.int32)
        self.request = comm.Iallreduce(self.flags, self.result, op=mpi.MAX)

    def Test(self) -> bool:
        return bool(self.request.Test())


# ---------------------------------------------------------------------------------------
# Ranks as threads of one process


class LoopbackError(RuntimeError):
    """The loopback ranks went wrong: a rank waited too long, for a rank that left, or the
    ranks posted calls that do not match (what would hang or corrupt an MPI job)."""


@dataclass
class _Collective:
    """The ``index``-th collective of the ranks: a broadcast or an agreement."""

    index: int
    kind: str  # "bcast" or "agree"
    root: int
    length: int
    data: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> its buffer (bcast)
    flags: dict[int, bool] = field(default_factory=dict)  # rank -> failed (agree)
    values: dict[int, float] = field(default_factory=dict)  # rank -> its value (max)
    done: bool = False
    answer: bool = False
    largest: float = 0.0


@dataclass
class _Message:
    """One point-to-point transfer from ``src`` to ``dst`` (the ``index``-th between them)."""

    src: int
    dst: int
    index: int
    sent: np.ndarray | None = None
    into: np.ndarray | None = None
    done: bool = False


@dataclass
class _Request:
    rank: int
    what: str
    collective: _Collective | None = None
    messages: list[_Message] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)

    def done(self) -> bool:
        if self.collective is not None:
            return self.collective.done
        return all(m.done for m in self.messages)

    def waits_for(self, size: int) -> set[int]:
        """The ranks whose call this request still needs."""
        if self.collective is not None:
            c = self.collective
            joined = c.data.keys() | c.flags.keys() | c.values.keys()
            return set(range(size)) - joined if not self.collective.done else set()
        return {m.src if m.dst == self.rank else m.dst for m in self.messages if not m.done}


class LoopbackHub:
    """What ``size`` loopback ranks share: their calls, matched as MPI matches them.

    A broadcast completes once every rank has posted it (the root's bytes copied into each
    receiver's buffer then); a point-to-point transfer once its root and that receiver have;
    an agreement once every rank has joined it (the OR of their flags). That is the most
    synchronous order MPI allows, so a driver that relies on anything looser hangs here too:
    a call not complete within ``timeout`` seconds, or waiting for a rank that left
    (:meth:`leave`, as a rank that died), raises :class:`LoopbackError` instead of hanging.
    """

    def __init__(self, size: int, timeout: float = 30.0) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._collectives: dict[int, _Collective] = {}
        self._joined = [0] * size  # collectives each rank has joined
        self._messages: dict[tuple[int, int, int, int], _Message] = {}  # (src, dst, tag, index)
        self._sent: dict[tuple[int, int, int], int] = {}  # (src, dst, tag) -> messages posted by src
        self._received: dict[tuple[int, int, int], int] = {}  # ... by dst
        self.left: dict[int, str] = {}  # rank -> why it left
        self.collectives = 0  # completed, for tests
        self.messages = 0
        self.link_bytes: dict[tuple[int, int], int] = {}  # (src, dst) -> bytes its point-to-point messages carried

    def transport(self, rank: int) -> LoopbackTransport:
        """Rank ``rank``'s end."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside 0..{self.size - 1}")
        return LoopbackTransport(self, rank)

    def leave(self, rank: int, why: str = "it left") -> None:
        """Rank ``rank`` makes no more calls (it finished, failed or died): whoever waits for it fails."""
        with self._cond:
            self.left.setdefault(rank, why)
            self._cond.notify_all()

    # -- calls (under the lock) -------------------------------------------------------------

    def _join(self, rank: int, kind: str, root: int, length: int) -> _Collective:
        index = self._joined[rank]
        self._joined[rank] += 1
        found = self._collectives.get(index)
        if found is None:
            found = self._collectives[index] = _Collective(index, kind, root, length)
        elif (found.kind, found.root, found.length) != (kind, root, length):
            raise LoopbackError(
                f"rank {rank}'s collective {index} is a {kind} from {root} of {length} bytes, "
                f"the others' a {found.kind} from {found.root} of {found.length} bytes"
            )
        return found

    def _complete(self, collective: _Collective) -> None:
        if len(collective.data) + len(collective.flags) + len(collective.values) < self.size:
            return
        if collective.kind == "bcast":
            sent = collective.data[collective.root]
            for rank, into in collective.data.items():
                if rank != collective.root:
                    into[:] = sent
        collective.answer = any(collective.flags.values())
        collective.largest = max(collective.values.values(), default=0.0)
        collective.done = True
        del self._collectives[collective.index]
        self.collectives += 1
        self._cond.notify_all()

    def post(self, rank: int, data: np.ndarray, root: int, receivers: Sequence[int] | None) -> _Request:
        with self._cond:
            self._check_alive(rank)
            if receivers is None:
                collective = self._join(rank, "bcast", root, len(data))
                collective.data[rank] = data
                self._complete(collective)
                return _Request(rank, f"broadcast {collective.index} from rank {root}", collective=collective)
            if rank == root:
                messages = [self._message(rank, root, peer, data) for peer in receivers]
            else:
                messages = [self._message(rank, root, rank, data)]
            return _Request(rank, f"transfer from rank {root}", messages=messages)

    def _message(self, rank: int, src: int, dst: int, data: np.ndarray, tag: int = P2P_TAG) -> _Message:
        """This rank's end (``rank`` is ``src`` or ``dst``) of the next message from ``src`` to ``dst``
        with ``tag``: matched, as MPI matches, in the order each end posts them."""
        stream = (src, dst, tag)
        counter = self._sent if rank == src else self._received
        index = counter.get(stream, 0)
        counter[stream] = index + 1
        key = (*stream, index)
        message = self._messages.setdefault(key, _Message(src, dst, index))
        if rank == src:
            message.sent = data
        else:
            message.into = data
        if message.sent is not None and message.into is not None:
            if len(message.sent) != len(message.into):
                raise LoopbackError(
                    f"rank {src} sends {len(message.sent)} bytes to rank {dst} (tag {tag}), "
                    f"which receives {len(message.into)}"
                )
            message.into[:] = message.sent
            message.done = True
            del self._messages[key]
            self.messages += 1
            self.link_bytes[(src, dst)] = self.link_bytes.get((src, dst), 0) + len(message.sent)
            self._cond.notify_all()
        return message

    def isend(self, rank: int, data: np.ndarray, dest: int, tag: int) -> _Request:
        """Start rank ``rank``'s message to ``dest``: complete once ``dest`` posted its receive."""
        with self._cond:
            self._check_alive(rank)
            return _Request(rank, f"send to rank {dest}", messages=[self._message(rank, rank, dest, data, tag)])

    def irecv(self, rank: int, data: np.ndarray, source: int, tag: int) -> _Request:
        """Start rank ``rank``'s receive from ``source``: complete once ``source`` posted its send."""
        with self._cond:
            self._check_alive(rank)
            message = self._message(rank, source, rank, data, tag)
            return _Request(rank, f"receive from rank {source}", messages=[message])

    def iagree(self, rank: int, failed: bool) -> _Request:
        """Join the next agreement without waiting for it."""
        with self._cond:
            self._check_alive(rank)
            collective = self._join(rank, "agree", -1, 0)
            collective.flags[rank] = failed
            self._complete(collective)
            return _Request(rank, f"agreement {collective.index}", collective=collective)

    def maximum(self, rank: int, value: float) -> float:
        """The largest of every rank's ``value`` (a collective: waits for every rank)."""
        with self._cond:
            self._check_alive(rank)
            collective = self._join(rank, "max", -1, 0)
            collective.values[rank] = value
            self._complete(collective)
            request = _Request(rank, f"maximum {collective.index}", collective=collective)
        self.wait(request)
        return collective.largest

    def agree(self, rank: int, failed: bool) -> bool:
        """Join the next agreement and wait for its answer."""
        request = self.iagree(rank, failed)
        self.wait(request)
        assert request.collective is not None
        return request.collective.answer

    def test(self, request: _Request) -> bool:
        with self._cond:
            if request.done():
                return True
            self._check_stuck(request)
            return False

    def wait(self, request: _Request) -> None:
        with self._cond:
            while not request.done():
                self._check_stuck(request)
                self._cond.wait(timeout=0.05)

    def _check_alive(self, rank: int) -> None:
        if rank in self.left:
            raise LoopbackError(f"rank {rank} called after it left ({self.left[rank]})")

    def _check_stuck(self, request: _Request) -> None:
        gone = sorted(r for r in request.waits_for(self.size) if r in self.left and r != request.rank)
        if gone:
            raise LoopbackError(
                f"rank {request.rank} waits in its {request.what} for rank {gone[0]}, which left ({self.left[gone[0]]})"
            )
        if time.monotonic() - request.since > self.timeout:
            waits = sorted(request.waits_for(self.size))
            raise LoopbackError(
                f"rank {request.rank}'s {request.what} did not complete in {self.timeout:g} s (waiting for {waits})"
            )


class LoopbackTransport:
    """One rank's end of a :class:`LoopbackHub` (a :class:`Transport`)."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        self.hub = hub
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.hub.size

    def post(self, data: np.ndarray, root: int, receivers: Sequence[int] | None) -> Request:
        return self.hub.post(self._rank, data, root, receivers)

    def test(self, request: Request) -> bool:
        return self.hub.test(request)

    def wait(self, request: Request) -> None:
        self.hub.wait(request)

    def agree(self, failed: bool, between: Callable[[], None] | None = None) -> bool:
        if between is None:
            return self.hub.agree(self._rank, failed)
        request = self.iagree(failed)
        while not self.hub.test(request):
            between()
            time.sleep(AGREE_NAP)
        return self.answer(request)

    # -- the point-to-point wire of a chain (fanout/chain.py) --------------------------------

    tag_limit = 32767  # MPI's least MPI_TAG_UB: the chains' tags wrap as they would there
    interleaves = False  # its messages complete as both ends post them, in any order

    def isend(self, data: np.ndarray, dest: int, tag: int) -> Request:
        return self.hub.isend(self._rank, data, dest, tag)

    def irecv(self, data: np.ndarray, source: int, tag: int) -> Request:
        return self.hub.irecv(self._rank, data, source, tag)

    def done(self, request: Request) -> bool:
        return self.hub.test(request)

    def iagree(self, failed: bool) -> Request:
        return self.hub.iagree(self._rank, failed)

    def answer(self, request: Request) -> bool:
        return bool(request.collective.answer)

    def maximum(self, value: float) -> float:
        return self.hub.maximum(self._rank, value)

    def die(self, why: str = "it died") -> None:
        """This rank stops making calls: every rank that waits for it fails instead of hanging."""
        self.hub.leave(self._rank, why)


__all__ = ["P2P_TAG", "LoopbackError", "LoopbackHub", "LoopbackTransport", "MpiTransport", "Request", "Transport"]
