"""The fan-out as pipelined chains of point-to-point messages (``--fanout chain``, ``ring``, ``auto``).

:class:`ChainTransport` is a :class:`azcp_cluster.fanout.transport.Transport`: the driver
posts a transfer as it posts a broadcast, and the transport carries it down the chain that
:mod:`azcp_cluster.core.chain` orders (the arithmetic, the tags, the piece size, the send
window and the choice of ``--fanout auto`` are there, pure). A receiver pre-posts a receive
for every piece of the transfer; as each piece arrives, in order, it sends that piece on to
the next rank, from the same slot (no copy). The sends in flight to the next rank are at
most a window of bytes (``core.chain.SendWindow``), the oldest transfer's first: posted all
at once, Open MPI's TCP path moves every message's fragments in turn and the first piece
arrives with the last. A transfer is complete on a rank once every piece has arrived and
every send it owes has completed, so its slot is free for the writers and then for the next
transfer.

MPI moves bytes only inside MPI calls, and forwarding is ours: the transport advances every
chain in flight at each call the driver makes (``test``, ``wait``) and while it waits in an
agreement, which is a non-blocking all-reduce for that reason: a rank blocked in an
agreement while a piece waits to be forwarded by it would leave the ranks downstream, and
then the agreement, waiting for ever.

It runs over a :class:`Wire` (isend, irecv, test, a non-blocking agreement):
``MpiTransport`` is one (MPI on the leaders' communicator), ``LoopbackTransport`` another
(ranks as threads, in tests).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from azcp_cluster.core.chain import (
    PROBE_BYTES,
    PROBE_PIECE,
    PROBE_WINDOW,
    FanoutChoice,
    Probe,
    SendWindow,
    chain_order,
    choose,
    needs_probe,
    neighbours,
    pair_tag,
    pieces,
)
from azcp_cluster.core.naps import nap_until
from azcp_cluster.fanout.transport import Request, Transport

# Seconds between looks at the chains while the driver waits (``wait``, an agreement): the
# first short (MPI moves bytes only inside its calls), growing while nothing completes.
WAIT_NAP = 0.0001
MAX_WAIT_NAP = 0.001  # a piece's transfer time on a fast link: a wait costs at most that


class Wire(Protocol):
    """Point-to-point messages between the ranks, and a non-blocking agreement."""

    @property
    def rank(self) -> int:
        """This rank."""

    @property
    def size(self) -> int:
        """How many ranks."""

    @property
    def tag_limit(self) -> int:
        """The largest tag a message may carry."""

    def isend(self, data: np.ndarray, dest: int, tag: int) -> Request:
        """Start sending ``data`` to ``dest``."""

    def irecv(self, data: np.ndarray, source: int, tag: int) -> Request:
        """Start receiving into ``data`` from ``source``."""

    def done(self, request: Request) -> bool:
        """Whether ``request`` completed (never blocks)."""

    def iagree(self, failed: bool) -> Request:
        """Start an agreement (every rank, at the same point): whether any rank failed."""

    def answer(self, request: Request) -> bool:
        """A completed agreement's answer."""

    def maximum(self, value: float) -> float:
        """The largest of every rank's ``value`` (blocks; every rank calls it at the same point)."""

    @property
    def interleaves(self) -> bool:
        """Whether the MPI moves the messages in flight to a peer together, not in order (see
        ``core.chain.SendWindow``)."""


@dataclass
class _Chain:
    """One transfer on this rank: its pieces received from the rank before, forwarded to the rank after."""

    data: np.ndarray
    slices: list[tuple[int, int]]
    after: int | None
    tag_out: int
    root: bool
    receives: list[Request] = field(default_factory=list)  # one per piece (none at the root)
    sends: deque[tuple[Request, int]] = field(default_factory=deque)  # posted, not complete, in order; bytes
    arrived: int = 0  # pieces received
    queued: int = 0  # pieces whose send was posted
    done: bool = False

    def collect(self, wire: Wire, window: SendWindow | None, now: float) -> None:
        """Count the pieces that arrived and the sends that completed (in order: the rank after
        matches them in that order)."""
        while self.arrived < len(self.receives) and wire.done(self.receives[self.arrived]):
            self.arrived += 1
        while self.sends and wire.done(self.sends[0][0]):
            _, nbytes = self.sends.popleft()
            if window is not None:
                window.sent(nbytes, now)

    def feed(self, wire: Wire, window: SendWindow | None, oldest: bool) -> None:
        """Post the sends of the pieces this rank has, in order, as far as the window allows;
        the oldest chain in flight may always have one (so it never waits on later ones, whose
        sends the ranks after may not match before it completes)."""
        if self.after is not None:
            ready = len(self.slices) if self.root else self.arrived
            while self.queued < ready:
                start, stop = self.slices[self.queued]
                if window is not None and not (window.allows(stop - start) or (oldest and not self.sends)):
                    break
                self.sends.append((wire.isend(self.data[start:stop], self.after, self.tag_out), stop - start))
                if window is not None:
                    window.started(stop - start)
                self.queued += 1
        sent_all = self.after is None or self.queued == len(self.slices)
        self.done = self.arrived == len(self.receives) and sent_all and not self.sends


class ChainTransport:
    """A :class:`Transport` whose every transfer flows down a pipelined chain of ``piece``-byte
    messages; with ``window``, at most a :class:`SendWindow` of them in flight to the rank
    after, from ``window_floor`` bytes on (None: WINDOW_MIN_BYTES; ``clock``: seconds, for the
    window's measure of the link)."""

    def __init__(
        self,
        wire: Wire,
        piece: int,
        window: bool = False,
        clock: Callable[[], float] = time.monotonic,
        window_floor: int | None = None,
    ) -> None:
        if piece < 1:
            raise ValueError("piece must be at least 1 byte")
        self.wire = wire
        self.piece = piece
        self.windowed = window
        self.window_floor = window_floor
        self._clock = clock
        self._sent: dict[int, int] = {}  # rank after -> transfers sent to it so far
        self._received: dict[int, int] = {}  # rank before -> transfers received from it so far
        self._windows: dict[int, SendWindow] = {}  # rank after -> the sends in flight to it
        self._live: list[_Chain] = []

    @property
    def rank(self) -> int:
        return self.wire.rank

    @property
    def size(self) -> int:
        return self.wire.size

    def post(self, data: np.ndarray, root: int, receivers: Sequence[int] | None) -> Request:
        """Start one transfer: the root sends every piece; another rank receives each and passes it on."""
        size, rank = self.wire.size, self.wire.rank
        others = receivers if receivers is not None else [r for r in range(size) if r != root]
        before, after = neighbours(chain_order(root, others, size), rank)
        slices = pieces(len(data), self.piece)
        tag_out = self._tag(self._sent, after) if after is not None else 0
        chain = _Chain(data, slices, after, tag_out, root=before is None)
        if before is None:  # the root: its first pieces at once, from its slot
            chain.feed(self.wire, self._window(after), oldest=not self._live)
        else:
            tag_in = self._tag(self._received, before)
            chain.receives = [self.wire.irecv(data[a:b], before, tag_in) for a, b in slices]
        # Nothing after the calls above may fail: the driver posts a transfer whose post raised
        # once more (as a failed root's), which would take the next tags of the pair and leave
        # its neighbours waiting. The chains move at the next test, wait or agreement.
        self._live.append(chain)
        return chain

    def test(self, request: Request) -> bool:
        """Whether transfer ``request`` completed; every chain in flight moves on meanwhile."""
        self._advance()
        return bool(request.done)

    def wait(self, request: Request) -> None:
        """Until transfer ``request`` completed, moving every chain in flight."""
        nap_until(lambda: self.test(request), WAIT_NAP, MAX_WAIT_NAP)

    def agree(self, failed: bool, between: Callable[[], None] | None = None) -> bool:
        """Whether any rank failed, the chains in flight moving while the others join (and
        ``between`` run: it must not block)."""
        request = self.wire.iagree(failed)

        def done() -> bool:
            self._advance()
            return self.wire.done(request)

        nap_until(done, WAIT_NAP, MAX_WAIT_NAP, between)
        return self.wire.answer(request)

    def _window(self, after: int | None) -> SendWindow | None:
        if after is None or not self.windowed:
            return None
        window = self._windows.get(after)
        if window is None:
            window = self._windows[after] = SendWindow(self.piece, self._clock(), self.window_floor)
        return window

    def _tag(self, counts: dict[int, int], peer: int) -> int:
        count = counts.get(peer, 0)
        counts[peer] = count + 1
        return pair_tag(count, self.wire.tag_limit)

    def _advance(self) -> None:
        """Forward every piece that has arrived, oldest transfer first, as the windows allow;
        drop the chains that completed."""
        now = self._clock()
        for chain in self._live:
            chain.collect(self.wire, self._window(chain.after), now)
        for i, chain in enumerate(self._live):
            chain.feed(self.wire, self._window(chain.after), oldest=i == 0)
        if any(chain.done for chain in self._live):
            self._live = [chain for chain in self._live if not chain.done]


class Fabric(Transport, Wire, Protocol):
    """What the leaders' link offers: broadcasts (a :class:`Transport`) and the wire a chain runs on."""


def probe(fabric: Fabric, nbytes: int = PROBE_BYTES, piece: int = PROBE_PIECE) -> Probe:
    """Time ``nbytes`` from rank 0 to every rank by MPI's broadcast and down a chain, each by its
    slowest rank (every rank of ``fabric`` calls it at the same point; about 2 · nbytes / B).

    Each is warmed first with a small message, so neither pays for opening connections.
    """
    chain = ChainTransport(fabric, piece, window=fabric.interleaves, window_floor=PROBE_WINDOW)
    buffer = np.zeros(nbytes, dtype=np.uint8)

    def timed(transport: Transport, data: np.ndarray) -> float:
        fabric.maximum(0.0)  # everyone starts together
        started = time.perf_counter()
        transport.wait(transport.post(data, 0, None))
        return fabric.maximum(time.perf_counter() - started)

    warm = buffer[: min(nbytes, 64 * 1024)]
    timed(fabric, warm)
    timed(chain, warm)
    return Probe(nbytes, ibcast_s=timed(fabric, buffer), chain_s=timed(chain, buffer), piece=piece)


def decide(
    fabric: Fabric, method: str, payload: int, piece: int | None = None, largest: int | None = None
) -> FanoutChoice:
    """``--fanout method`` for ``payload`` bytes over the fabric's ranks (``largest``: the largest
    transfer): probed first where auto asks for it (every rank of ``fabric`` calls it at the
    same point, with the same arguments)."""
    measured = probe(fabric) if needs_probe(method, fabric.size, payload) else None
    return choose(method, fabric.size, payload, piece, measured, largest, fabric.interleaves)


def transport_for(fabric: Fabric, choice: FanoutChoice) -> Transport:
    """The transport that carries out ``choice``."""
    return ChainTransport(fabric, choice.piece, choice.window) if choice.method == "chain" else fabric


__all__ = ["ChainTransport", "Fabric", "Wire", "decide", "probe", "transport_for"]
