"""Pipelined chains of point-to-point messages: the fan-out's arithmetic for ``--fanout``. Pure code.

A transfer (one root, its receivers) flows along a chain: the root sends its bytes, in
pieces, to the next node; each node forwards every piece to the node after it as soon as
the piece has arrived, and writes it. Every link carries each byte once, so a transfer
takes about its length over the link's rate (B), whatever the number of nodes, plus the
time to fill the pipe: its first piece crosses nodes − 1 links, (nodes − 2) · piece / B
beyond its bytes. MPI's own broadcasts do not: a binomial
tree sends log2(N) copies out of the root, a scatter-allgather about 1.75 at 8 nodes.

The order along the chain follows the hosts around a ring, starting at the root: rank
``root``, then ``root + 1``, … (those that receive it), wrapping at the end. With one root (a
local SOURCE) every transfer runs down the same chain; with many (each node downloaded a
share) the chains of the transfers in flight together make a ring, each node forwarding
what its predecessor sends except what came from its successor, so every node's link
carries S·(N − 1)/N: the bound of data spread over N nodes.

Messages are matched by tag: the ``k``-th transfer that rank ``a`` sends to rank ``b`` is the
``k``-th that ``b`` receives from ``a`` (both post their transfers in schedule order), and its
pieces carry the tag of ``k``; within a transfer MPI keeps the pieces of one sender and tag
in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB

# What --fanout accepts. "chain" and "ring" are one transport (see the module): "ring"
# names it for transfers from many roots.
FANOUT_METHODS = ("auto", "chain", "ring", "ibcast")
# Tags below this are the tool's other point-to-point messages on the same communicator
# (transport.P2P_TAG, streaming.LANDED_TAG).
TAG_BASE = 64
# A chain's piece size, when not given: the largest power of two whose pipe fill costs at
# most FILL_SHARE of the fan-out, within these bounds. Below MIN_PIECE the per-message cost
# (a Python call and MPI's matching, some microseconds) shows; above MAX_PIECE the pipe
# fills for nothing.
MIN_PIECE = 256 * KiB
MAX_PIECE = 4 * MiB
DEFAULT_PIECE = 1 * MiB  # when the payload is unknown: inside the bounds, fill small at 8 nodes
FILL_SHARE = 0.02  # the pipe fill a chain may cost: 2 % of the fan-out
# The piece size --fanout-piece accepts: wider than the chosen bounds, for experiments.
MIN_PIECE_OPTION = 4 * KiB
MAX_PIECE_OPTION = 256 * MiB
# --fanout auto: no probe below this many bytes to fan out (it would cost more than any
# choice saves; the chain, at the bound on every fabric measured, is taken), nor on two
# nodes (a chain of two is one point-to-point transfer, as a broadcast between two is).
PROBE_MIN_PAYLOAD = 256 * MiB
# The probe: this many bytes sent once by each method, paid once per run inside it: the
# smallest that still ranks the two methods (docs/benchmarks.md, *Why the constants are what
# they are*: the sizes tried).
PROBE_BYTES = 1 * MiB
# The probe's chain pieces: small enough that its pipe fill ((N - 2) pieces) stays under its
# bytes at eight nodes.
PROBE_PIECE = 128 * KiB
# Under an MPI that interleaves (FanoutChoice.window) the probe's chain keeps at most this
# many bytes in flight to the next rank, as a run's first window does, so that the probe
# times the pattern the run will use (docs/benchmarks.md: without it the chain timed slow).
PROBE_WINDOW = 4 * PROBE_PIECE
# The chain is kept unless the broadcast would be faster by more than this share, for the
# payload, from the probe (Probe.expected; a tie is the chain's: its time does not grow
# with the nodes, the broadcast's may).
PROBE_MARGIN = 0.10

# Sends in flight from a rank to the rank after it, under an MPI that moves the messages in
# flight to a peer together (FanoutChoice.window): SendWindow. Open MPI's TCP path pushes
# the fragments of every message in flight to a peer in turn, so with a transfer's every
# piece posted at once each node forwards late; MPICH sends in order and needs no window
# (docs/benchmarks.md has the figures of both).
# The window starts at WINDOW_MIN_BYTES (WINDOW_MIN_PIECES pieces or more) and grows to
# what the link took in WINDOW_COVER seconds, measured over WINDOW_SAMPLE seconds or more:
# a fast link (InfiniBand) drains a small window between two looks of the driver, a slow
# one never does. What sits in the window when a sample starts adds at most a quarter of
# it to the next limit (the sample is four covers), so a slow link keeps the smallest.
WINDOW_MIN_BYTES = 2 * MiB  # a window that a slow link never drains: the smallest kept
WINDOW_MIN_PIECES = 2  # at least two pieces, so one is in flight while the next is posted
WINDOW_COVER = 0.01  # a window of 10 ms of the link: longer than the driver's naps
WINDOW_SAMPLE = 0.04  # four covers: what sits in the window skews a sample by a quarter


def chain_order(root: int, receivers: Sequence[int], size: int) -> tuple[int, ...]:
    """The ranks a transfer flows through: ``root``, then its receivers from ``root + 1`` on, around the ring."""
    if not 0 <= root < size:
        raise ValueError(f"root {root} outside 0..{size - 1}")
    rest = sorted(set(receivers), key=lambda r: (r - root) % size)
    if root in rest or any(not 0 <= r < size for r in rest):
        raise ValueError(f"receivers {list(receivers)} must be ranks of 0..{size - 1} other than the root {root}")
    return (root, *rest)


def neighbours(order: Sequence[int], rank: int) -> tuple[int | None, int | None]:
    """The rank ``rank`` receives a transfer from and the one it forwards it to (None: it is the root, or the last)."""
    at = list(order).index(rank)
    before = order[at - 1] if at > 0 else None
    after = order[at + 1] if at + 1 < len(order) else None
    return before, after


def pieces(length: int, piece: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each piece of a transfer of ``length`` bytes (at least one, for an empty transfer)."""
    if piece < 1:
        raise ValueError("piece must be at least 1 byte")
    if length <= 0:
        return [(0, 0)]
    return [(start, min(length, start + piece)) for start in range(0, length, piece)]


def pair_tag(count: int, tag_limit: int) -> int:
    """The tag of the ``count``-th transfer between two ranks, on a communicator whose tags go to ``tag_limit``.

    Tags repeat after ``tag_limit − TAG_BASE + 1`` transfers; a rank has at most its pipeline's
    transfers in flight, far fewer, so two transfers in flight between a pair never share one.
    """
    span = tag_limit - TAG_BASE + 1
    if span < 2:
        raise ValueError(f"the communicator's tags end at {tag_limit}, below {TAG_BASE + 1}")
    return TAG_BASE + count % span


def piece_size(payload: int, nodes: int) -> int:
    """The chain's piece for ``payload`` bytes to fan out over ``nodes`` nodes: the largest power of
    two with (nodes − 1) · piece ≤ FILL_SHARE · payload, within MIN_PIECE..MAX_PIECE."""
    if nodes < 2 or payload <= 0:
        return DEFAULT_PIECE
    fits = FILL_SHARE * payload / (nodes - 1)
    piece = MIN_PIECE
    while piece * 2 <= min(fits, MAX_PIECE):
        piece *= 2
    return piece


class SendWindow:
    """How many bytes a rank may have in flight to one neighbour (see WINDOW_MIN_BYTES):
    :meth:`allows` before each send, :meth:`sent` as each completes, with the time from the
    caller's clock."""

    def __init__(self, piece: int, now: float, floor: int | None = None) -> None:
        if piece < 1:
            raise ValueError("piece must be at least 1 byte")
        # ``floor``: WINDOW_MIN_BYTES unless given (the probe's, PROBE_WINDOW, is smaller).
        self.limit = max(WINDOW_MIN_BYTES if floor is None else floor, WINDOW_MIN_PIECES * piece)
        self.in_flight = 0
        self._since = now
        self._bytes = 0

    def allows(self, nbytes: int) -> bool:
        """Whether a send of ``nbytes`` may start now (always, when nothing is in flight)."""
        return self.in_flight == 0 or self.in_flight + nbytes <= self.limit

    def started(self, nbytes: int) -> None:
        """A send of ``nbytes`` started."""
        self.in_flight += nbytes

    def sent(self, nbytes: int, now: float) -> None:
        """A send of ``nbytes`` completed at ``now``; the window grows to what the link takes in
        WINDOW_COVER seconds, by each sample of WINDOW_SAMPLE seconds or more."""
        self.in_flight -= nbytes
        self._bytes += nbytes
        elapsed = now - self._since
        if elapsed >= WINDOW_SAMPLE:
            self.limit = max(self.limit, int(self._bytes / elapsed * WINDOW_COVER))
            self._since, self._bytes = now, 0


@dataclass(frozen=True)
class Probe:
    """What the start-up probe measured: ``nbytes`` sent once by MPI's broadcast and once down a
    chain, each timed by its slowest rank."""

    nbytes: int
    ibcast_s: float
    chain_s: float
    piece: int = PROBE_PIECE  # the chain's pieces in the probe

    def expected(self, nodes: int, payload: int, piece: int) -> tuple[float, float]:
        """What each method would take to fan ``payload`` bytes out to ``nodes`` nodes (the chain in
        ``piece``-byte pieces), from what the probe measured: (broadcast, chain) seconds.

        A chain's time is its bytes plus its pipe fill, (nodes − 2) pieces, over its rate; the
        probe's fill is of probe pieces and the payload's of its own, so the probe's time per
        byte of both is what scales. A broadcast's time scales with its bytes. Compared as
        measured, the fill would decide at scale: at 32 nodes a 1 MiB probe in 128 KiB pieces
        carries 30 pieces of fill for 8 of bytes, and the broadcast would win a probe that it
        loses on every gigabyte after it.
        """
        fill = max(0, nodes - 2)
        per_byte = self.chain_s / (self.nbytes + fill * self.piece)
        return self.ibcast_s * payload / self.nbytes, per_byte * (payload + fill * piece)

    def as_dict(self) -> dict[str, float | int]:
        """The report's form."""
        return {"bytes": self.nbytes, "ibcast_s": round(self.ibcast_s, 6), "chain_s": round(self.chain_s, 6)}


@dataclass(frozen=True)
class FanoutChoice:
    """The fan-out's transport for a run: ``method`` ("chain" or "ibcast"), a chain's piece size
    (0 for the broadcast, which has none), why, and whether a chain keeps its sends in flight
    to a :class:`SendWindow` (``window``)."""

    method: str
    piece: int
    reason: str
    probe: Probe | None = None
    window: bool = False

    def as_dict(self) -> dict[str, object]:
        """The report's form."""
        out: dict[str, object] = {"method": self.method, "reason": self.reason}
        if self.piece:
            out["piece"] = self.piece
        if self.window:
            out["send_window"] = True
        if self.probe is not None:
            out["probe"] = self.probe.as_dict()
        return out


def needs_probe(method: str, nodes: int, payload: int) -> bool:
    """Whether ``--fanout auto`` measures the fabric before choosing (see PROBE_MIN_PAYLOAD)."""
    return method == "auto" and nodes > 2 and payload >= PROBE_MIN_PAYLOAD


def choose(
    method: str,
    nodes: int,
    payload: int,
    piece: int | None = None,
    probe: Probe | None = None,
    largest: int | None = None,
    interleaves: bool = False,
) -> FanoutChoice:
    """The transport for ``--fanout method`` over ``nodes`` nodes fanning out ``payload`` bytes;
    ``piece``: ``--fanout-piece`` (None: from :func:`piece_size`); ``probe``: what auto measured;
    ``largest``: the largest transfer (a chain cuts each transfer on its own, so no piece of it
    is larger, nor its pipe fill); ``interleaves``: the MPI moves the messages in flight to a
    peer together (a chain then keeps a :class:`SendWindow`)."""
    if method not in FANOUT_METHODS:
        raise ValueError(f"unknown fan-out method {method!r}")
    size = piece if piece is not None else piece_size(payload, nodes)
    if method == "ibcast":
        return FanoutChoice("ibcast", 0, "--fanout ibcast")
    if method in ("chain", "ring"):
        return FanoutChoice("chain", size, f"--fanout {method}", window=interleaves)
    if probe is None:
        why = "two nodes" if nodes <= 2 else f"under {PROBE_MIN_PAYLOAD // MiB} MiB to fan out"
        return FanoutChoice("chain", size, f"auto: {why}, no probe", window=interleaves)
    ibcast_s, chain_s = probe.expected(nodes, payload, min(size, largest) if largest else size)
    if ibcast_s * (1 + PROBE_MARGIN) < chain_s:
        return FanoutChoice("ibcast", 0, "auto: from the probe, the broadcast would be faster", probe)
    reason = "auto: from the probe, the chain would be as fast or faster"
    return FanoutChoice("chain", size, reason, probe, window=interleaves)


__all__ = [
    "DEFAULT_PIECE",
    "FANOUT_METHODS",
    "MAX_PIECE_OPTION",
    "MIN_PIECE_OPTION",
    "PROBE_BYTES",
    "PROBE_PIECE",
    "PROBE_WINDOW",
    "TAG_BASE",
    "FanoutChoice",
    "Probe",
    "SendWindow",
    "chain_order",
    "choose",
    "needs_probe",
    "neighbours",
    "pair_tag",
    "piece_size",
    "pieces",
]
