"""Pipelined chains and rings (``--fanout chain|ring|auto``): the pure arithmetic, then the real
driver over :class:`ChainTransport` on the loopback wire (ranks as threads, DESTs on tmp_path).

The loopback matches every message only once both ends posted it (the most synchronous order
MPI allows) and counts the bytes each link carried, so these tests see what a fabric would:
which links a transfer used, and whether a rank that forgot to forward left another waiting.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.chain import (
    FILL_SHARE,
    MAX_PIECE,
    MIN_PIECE,
    PROBE_BYTES,
    PROBE_MIN_PAYLOAD,
    PROBE_PIECE,
    PROBE_WINDOW,
    TAG_BASE,
    WINDOW_COVER,
    WINDOW_MIN_BYTES,
    Probe,
    SendWindow,
    chain_order,
    choose,
    needs_probe,
    neighbours,
    pair_tag,
    piece_size,
    pieces,
)
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import UsageError
from azcp_cluster.core.fanout import Agree, Post, Write
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.fanout.chain import ChainTransport, decide, probe, transport_for
from azcp_cluster.fanout.events import FanOutStats
from azcp_cluster.fanout.transport import LoopbackError, LoopbackHub, LoopbackTransport, Request
from tests.conftest import REPO, assert_copies, mpi_flavour, run_cli, tree_of
from tests.test_transport import assert_nothing_wrong, fail_at_every_instruction, fan_out, md5, world

MiB = 1 << 20
PROBE_ALWAYS = REPO / "tests" / "programs" / "probe_always.py"
PIECE = 8192  # small pieces: many per slot (the test world's slots are 64 KiB)

# ---------------------------------------------------------------------------------------
# The arithmetic


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_chain_starts_at_its_root_and_goes_round_the_ring(data: st.DataObject) -> None:
    size = data.draw(st.integers(1, 16))
    root = data.draw(st.integers(0, size - 1))
    receivers = data.draw(st.sets(st.integers(0, size - 1).filter(lambda r: r != root)))
    order = chain_order(root, sorted(receivers, reverse=True), size)
    assert order[0] == root and set(order[1:]) == receivers and len(order) == len(receivers) + 1
    steps = [(b - root) % size for b in order]
    assert steps == sorted(steps), order  # never back past the root
    for at, rank in enumerate(order):
        before, after = neighbours(order, rank)
        assert before == (order[at - 1] if at else None)
        assert after == (order[at + 1] if at + 1 < len(order) else None)


def test_a_chain_refuses_ranks_outside_the_communicator_and_the_root_as_a_receiver() -> None:
    with pytest.raises(ValueError):
        chain_order(4, [1], 4)
    with pytest.raises(ValueError):
        chain_order(0, [0, 1], 4)
    with pytest.raises(ValueError):
        chain_order(0, [5], 4)


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16])
def test_with_every_node_a_root_each_link_carries_all_but_one_roots_share(size: int) -> None:
    """The ring: a transfer from every root to all others; each link i -> i+1 carries every
    root's but i+1's, so S(N-1)/N of S spread evenly: the bound of data spread over N nodes."""
    links: Counter[tuple[int, int]] = Counter()
    for root in range(size):
        order = chain_order(root, [r for r in range(size) if r != root], size)
        links.update(itertools.pairwise(order))
    assert set(links) == {(i, (i + 1) % size) for i in range(size)}
    assert set(links.values()) == {size - 1}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2**20), st.integers(0, 300), st.integers(0, 2**20))
def test_pieces_cover_a_transfer_in_order_none_too_long(piece: int, whole: int, part: int) -> None:
    length = whole * piece + part % piece
    cut = pieces(length, piece)
    assert cut[0][0] == 0 and cut[-1][1] == max(length, 0)
    assert all(a < b or length == 0 for a, b in cut)
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(cut))
    assert all(b - a <= piece for a, b in cut)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**9), st.sampled_from([TAG_BASE + 1, 32767, 2**21 - 1, 2**31 - 1]))
def test_tags_stay_in_range_and_differ_for_transfers_in_flight(count: int, limit: int) -> None:
    tags = [pair_tag(count + k, limit) for k in range(min(64, limit - TAG_BASE + 1))]
    assert all(TAG_BASE <= t <= limit for t in tags)
    assert len(set(tags)) == len(tags)


def test_a_communicator_with_too_few_tags_is_refused() -> None:
    with pytest.raises(ValueError):
        pair_tag(0, TAG_BASE)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2**42), st.integers(2, 512))
def test_the_piece_is_a_power_of_two_whose_pipe_fill_is_small(payload: int, nodes: int) -> None:
    piece = piece_size(payload, nodes)
    assert piece & (piece - 1) == 0 and MIN_PIECE <= piece <= MAX_PIECE
    if piece > MIN_PIECE:  # the fill share holds unless the floor is reached
        assert (nodes - 1) * piece <= FILL_SHARE * payload
    if piece < MAX_PIECE:  # and it is the largest that does
        assert (nodes - 1) * 2 * piece > FILL_SHARE * payload


def test_the_choice_of_transport() -> None:
    big = PROBE_MIN_PAYLOAD
    assert choose("ibcast", 8, big).method == "ibcast"
    assert choose("chain", 8, big).method == "chain" and choose("ring", 8, big).method == "chain"
    assert choose("chain", 8, big, piece=65536).piece == 65536
    assert not needs_probe("auto", 2, 10 * big) and not needs_probe("auto", 8, big - 1)
    assert not needs_probe("chain", 8, big) and needs_probe("auto", 3, big)
    assert choose("auto", 8, 1).method == "chain" and "no probe" in choose("auto", 8, 1).reason
    slow_bcast = Probe(4 << 20, ibcast_s=0.3, chain_s=0.1)
    fast_bcast = Probe(4 << 20, ibcast_s=0.1, chain_s=0.3)
    # A tie once the chain's pipe fill in the probe (6 probe pieces at 8 nodes) is taken out.
    tie = Probe(4 << 20, ibcast_s=0.1, chain_s=0.105 * ((4 << 20) + 6 * PROBE_PIECE) / (4 << 20))
    assert choose("auto", 8, big, probe=slow_bcast).method == "chain"
    assert choose("auto", 8, big, probe=fast_bcast).method == "ibcast"
    assert choose("auto", 8, big, probe=tie).method == "chain"
    report = choose("auto", 8, big, probe=fast_bcast).as_dict()
    assert report["probe"] == {"bytes": 4 << 20, "ibcast_s": 0.1, "chain_s": 0.3}
    with pytest.raises(ValueError):
        choose("tree", 8, big)


def test_a_chain_keeps_a_send_window_only_under_an_mpi_that_interleaves_its_sends() -> None:
    for method in ("auto", "chain", "ring"):
        assert choose(method, 4, MiB, interleaves=True).window
        assert not choose(method, 4, MiB).window
    assert choose("auto", 4, MiB, interleaves=True).as_dict()["send_window"] is True
    assert "send_window" not in choose("auto", 4, MiB).as_dict()
    assert not choose("ibcast", 4, MiB, interleaves=True).window
    slow_chain = Probe(PROBE_BYTES, ibcast_s=0.01, chain_s=1.0)
    assert not choose("auto", 8, PROBE_MIN_PAYLOAD, probe=slow_chain, interleaves=True).window  # the broadcast
    hub = LoopbackHub(2)
    windowed = transport_for(hub.transport(0), choose("chain", 2, MiB, interleaves=True))
    assert isinstance(windowed, ChainTransport) and windowed.windowed
    plain = transport_for(hub.transport(0), choose("chain", 2, MiB))
    assert isinstance(plain, ChainTransport) and not plain.windowed


def test_the_probe_is_read_for_the_payload_not_for_itself() -> None:
    """At 32 nodes a 1 MiB probe in 128 KiB pieces carries 30 pieces of pipe fill for 8 of
    bytes: a chain at the links' rate B takes 4.75 x the probe's bytes over B, a
    scatter-allgather broadcast about 2 x. As measured the broadcast wins; on 10 GiB the chain
    takes about 1 x and the broadcast 2 x, and the chain is chosen."""
    b = 100e6
    fill = 30 * PROBE_PIECE
    chain_like = Probe(PROBE_BYTES, ibcast_s=2 * PROBE_BYTES / b, chain_s=(PROBE_BYTES + fill) / b)
    assert chain_like.ibcast_s < chain_like.chain_s
    payload = 10 << 30
    piece = piece_size(payload, 32)
    ibcast_s, chain_s = chain_like.expected(32, payload, piece)
    assert ibcast_s == pytest.approx(2 * payload / b)
    assert chain_s == pytest.approx((payload + 30 * piece) / b)
    chosen = choose("auto", 32, payload, probe=chain_like)
    assert chosen.method == "chain" and chosen.piece == piece and "from the probe" in chosen.reason
    # A chain cuts each transfer on its own: --fanout-piece 64MiB with 16 MiB transfers fills
    # the pipe with 16 MiB pieces, not 64 (the review's case: the fill counted 4 x too large).
    close = Probe(PROBE_BYTES, ibcast_s=PROBE_BYTES / b, chain_s=0.95 * (PROBE_BYTES + fill) / b)
    assert choose("auto", 32, payload, piece=64 << 20, probe=close, largest=16 << 20).method == "chain"
    assert choose("auto", 32, payload, piece=64 << 20, probe=close).method == "ibcast"  # unclamped: 30 x 64 MiB
    # A broadcast faster per byte than the chain's links is still taken.
    tree_like = Probe(PROBE_BYTES, ibcast_s=0.5 * PROBE_BYTES / b, chain_s=(PROBE_BYTES + fill) / b)
    assert choose("auto", 32, payload, probe=tree_like).method == "ibcast"


def _look_at_a_link(rate: float, piece: int, look: float, seconds: float, buffered: bool) -> tuple[SendWindow, float]:
    """A sender that looks every ``look`` seconds, counting the sends a link of ``rate`` bytes/s
    completed (in order) and posting pieces while its window allows; ``buffered``: the first
    look finds everything posted already sent (socket buffers took it). The window, and the
    share of the last half of the time the link was busy."""
    window = SendWindow(piece, 0.0)
    in_flight: list[int] = []
    credit, busy, now = 0.0, 0.0, 0.0
    while now < seconds:
        while window.allows(piece):
            window.started(piece)
            in_flight.append(piece)
        now += look
        work = min(rate * look, sum(in_flight) - credit)
        credit += work
        if now >= seconds / 2:
            busy += work / rate
        if buffered and now == look:
            credit = float(sum(in_flight))
        while in_flight and credit >= in_flight[0]:
            credit -= in_flight[0]
            window.sent(in_flight.pop(0), now)
    return window, busy / (seconds / 2)


def test_a_send_window_starts_at_two_mib_or_two_pieces_and_always_lets_one_send_go() -> None:
    assert SendWindow(512 * 1024, 0.0).limit == WINDOW_MIN_BYTES == 2 * MiB
    window = SendWindow(4 * MiB, 0.0)
    assert window.limit == 8 * MiB
    assert window.allows(64 * MiB)  # nothing in flight: a piece larger than the window still goes
    window.started(4 * MiB)
    assert window.allows(4 * MiB)
    window.started(4 * MiB)
    assert not window.allows(1)
    window.sent(4 * MiB, 0.001)
    assert window.in_flight == 4 * MiB and window.allows(4 * MiB)
    with pytest.raises(ValueError):
        SendWindow(0, 0.0)


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(1e6, 125e6),  # up to 1 Gbit/s
    piece=st.sampled_from([MIN_PIECE, 512 * 1024, MiB, 2 * MiB, MAX_PIECE]),
    look=st.floats(0.0005, 0.004),
    buffered=st.booleans(),
)
def test_a_send_window_stays_small_on_a_slow_link(rate: float, piece: int, look: float, buffered: bool) -> None:
    """Where a small window keeps the link busy anyway (Open MPI's TCP path interleaves what is
    in flight: the smaller, the sooner each piece arrives), it does not grow."""
    window, busy = _look_at_a_link(rate, piece, look, 2.0, buffered)
    assert window.limit == max(WINDOW_MIN_BYTES, 2 * piece)
    assert busy > 0.95


@settings(max_examples=40, deadline=None)
@given(
    rate=st.floats(1e9, 50e9),  # 8 to 400 Gbit/s
    piece=st.sampled_from([MIN_PIECE, MiB, MAX_PIECE]),
    look=st.floats(0.0005, 0.002),
    buffered=st.booleans(),
)
def test_a_send_window_grows_until_a_fast_link_never_waits_between_looks(
    rate: float, piece: int, look: float, buffered: bool
) -> None:
    """A fabric that drains the smallest window between two looks of the driver: within a
    second the window covers several looks, and the link is busy, not starved; it never
    grows far past what the link takes in WINDOW_COVER (that would be Open MPI's interleaving
    again, on a fast link)."""
    window, busy = _look_at_a_link(rate, piece, look, 1.0, buffered)
    assert window.limit >= 2 * rate * look
    assert busy > 0.95
    assert window.limit <= 1.5 * rate * WINDOW_COVER + 2 * piece


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"fanout": "tree"}, "--fanout must be one of auto, chain, ring, ibcast"),
        ({"fanout_piece": 1000}, "--fanout-piece must be between 4.00 KiB and 256.00 MiB"),
        ({"fanout_piece": 1 << 30}, "--fanout-piece must be between"),
    ],
)
def test_bad_fanout_options_are_named(fields: dict[str, object], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        Config(source="/src", dest="/dst", **fields).validate()  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# The transport on its own


def _threads(size: int, work: object) -> list[object]:
    """``work(rank)`` on ``size`` threads; each one's result or exception."""
    results: list[object] = [None] * size

    def one(rank: int) -> None:
        try:
            results[rank] = work(rank)  # type: ignore[operator]
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank hung"
    return results


def test_a_rank_that_agrees_while_it_still_has_pieces_to_forward_forwards_them() -> None:
    """Rank 1 joins an agreement right after posting its part of a chain 0 -> 1 -> 2; rank 2 waits
    for the transfer before it joins. A blocking agreement on rank 1 would leave both waiting."""
    hub = LoopbackHub(3, timeout=10)
    sent = np.arange(100_000, dtype=np.uint64).view(np.uint8).copy()

    def rank(r: int) -> object:
        chain = ChainTransport(hub.transport(r), 4096)
        data = sent.copy() if r == 0 else np.zeros_like(sent)
        request = chain.post(data, 0, None)
        if r == 2:
            chain.wait(request)
        answer = chain.agree(r == 1)
        chain.wait(request)
        return answer, bytes(data) == bytes(sent)

    assert _threads(3, rank) == [(True, True)] * 3


def test_transfers_from_many_roots_in_flight_at_once_are_matched_by_their_tags() -> None:
    """Four transfers in flight, from roots 0, 1, 2, 0, over 3 ranks: a forwarder sends pieces of
    several transfers to the same rank interleaved, as they arrive; each lands in its own buffer."""
    hub = LoopbackHub(3, timeout=10)
    roots = [0, 1, 2, 0]
    payloads = [np.frombuffer(bytes([i + 1]) * (30_000 + 999 * i), dtype=np.uint8) for i in range(len(roots))]

    def rank(r: int) -> object:
        chain = ChainTransport(hub.transport(r), 1000)
        buffers = [p.copy() if root == r else np.zeros_like(p) for p, root in zip(payloads, roots, strict=True)]
        requests = [chain.post(b, root, None) for b, root in zip(buffers, roots, strict=True)]
        for request in requests:
            chain.wait(request)
        return all(bytes(b) == bytes(p) for b, p in zip(buffers, payloads, strict=True))

    assert _threads(3, rank) == [True] * 3
    total = sum(len(p) for p in payloads)
    # Each link carried the transfers that pass it: all but those whose root is its far end.
    for (src, dst), carried in hub.link_bytes.items():
        assert dst == (src + 1) % 3
        assert carried == total - sum(len(p) for p, root in zip(payloads, roots, strict=True) if root == dst)


class SlowSends(LoopbackTransport):
    """A loopback rank whose sends complete only after ``looks`` looks at them (a link takes
    time), counting the bytes this rank has in flight to each rank at once."""

    def __init__(self, hub: LoopbackHub, rank: int, looks: int = 3) -> None:
        super().__init__(hub, rank)
        self.looks = looks
        self._sends: dict[int, tuple[int, int, int]] = {}  # id(request) -> (dest, bytes, looks so far)
        self.in_flight: Counter[int] = Counter()
        self.most: Counter[int] = Counter()

    def isend(self, data: np.ndarray, dest: int, tag: int) -> Request:
        request = super().isend(data, dest, tag)
        self._sends[id(request)] = (dest, len(data), 0)
        self.in_flight[dest] += len(data)
        self.most[dest] = max(self.most[dest], self.in_flight[dest])
        return request

    def done(self, request: Request) -> bool:
        if id(request) not in self._sends:
            return super().done(request)
        dest, nbytes, looks = self._sends[id(request)]
        if looks < self.looks or not super().done(request):
            self._sends[id(request)] = (dest, nbytes, looks + 1)
            return False
        del self._sends[id(request)]
        self.in_flight[dest] -= nbytes
        return True


@pytest.mark.parametrize("roots", [[0, 0, 0, 0], [0, 1, 2, 3, 0, 2]], ids=["one-root", "many-roots"])
def test_a_rank_has_at_most_its_window_in_flight_to_the_rank_after_and_every_chain_completes(
    monkeypatch: pytest.MonkeyPatch, roots: list[int]
) -> None:
    """With windows of two pieces and sends that take a while, transfers from several roots in
    flight over 4 ranks, posted as the driver posts them: no rank ever has more than its window
    (and the oldest transfer's one send beyond it) in flight to the next, the window is used,
    and every copy completes, byte-identical."""
    monkeypatch.setattr("azcp_cluster.core.chain.WINDOW_MIN_BYTES", 1)
    hub = LoopbackHub(4, timeout=20)
    piece = 1000
    payloads = [np.frombuffer(bytes([i + 1]) * (9_500 + 700 * i), dtype=np.uint8) for i in range(len(roots))]
    wires = [SlowSends(hub, r) for r in range(4)]

    def rank(r: int) -> object:
        chain = ChainTransport(wires[r], piece, window=True, clock=lambda: 0.0)  # a clock standing still
        buffers = [p.copy() if root == r else np.zeros_like(p) for p, root in zip(payloads, roots, strict=True)]
        # Two transfers in flight at most, the next posted once the oldest completed (as the
        # driver's slots allow): a rank ahead sends pieces of a transfer the next has not posted.
        requests = deque(chain.post(b, root, None) for b, root in zip(buffers[:2], roots[:2], strict=True))
        for b, root in zip(buffers[2:], roots[2:], strict=True):
            chain.wait(requests.popleft())
            requests.append(chain.post(b, root, None))
        for request in requests:
            chain.wait(request)
        return all(bytes(b) == bytes(p) for b, p in zip(buffers, payloads, strict=True))

    assert _threads(4, rank) == [True] * 4
    for wire in wires:
        assert set(wire.most) <= {(wire.rank + 1) % 4}
        assert all(most <= 2 * piece + piece for most in wire.most.values()), wire.most
        assert all(most >= 2 * piece for most in wire.most.values()), wire.most  # the window was used


def test_without_a_window_every_piece_is_in_flight_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain without a window (under MPICH, which sends in order) posts a root's every piece
    at once; with one, no more than the window (this also guards the test above)."""
    monkeypatch.setattr("azcp_cluster.core.chain.WINDOW_MIN_BYTES", 1)
    payload = np.arange(40_000, dtype=np.uint8)
    for window, most in ((False, len(payload)), (True, 2 * 1000)):
        hub = LoopbackHub(2, timeout=10)
        wires = [SlowSends(hub, r) for r in range(2)]

        def rank(r: int) -> object:
            chain = ChainTransport(wires[r], 1000, window=window, clock=lambda: 0.0)  # noqa: B023 (run at once)
            data = payload.copy() if r == 0 else np.zeros_like(payload)
            chain.wait(chain.post(data, 0, None))
            return bytes(data) == bytes(payload)

        assert _threads(2, rank) == [True] * 2
        assert wires[0].most[1] == most, (window, wires[0].most)


class InterleavingSlowSends(SlowSends):
    """:class:`SlowSends` on an MPI that moves the messages in flight to a peer together (Open MPI)."""

    interleaves = True


def test_the_probe_keeps_its_own_window_under_an_mpi_that_interleaves() -> None:
    """Under Open MPI the probe's chain keeps at most PROBE_WINDOW in flight to the next rank, a
    part of the probe, as a run's chain keeps its first window: with the run's 2 MiB the whole
    probe went at once, and the chain was timed as the window exists to avoid."""
    assert PROBE_PIECE < PROBE_WINDOW < PROBE_BYTES
    size = 4
    hub = LoopbackHub(size, timeout=20)
    wires = [InterleavingSlowSends(hub, r) for r in range(size)]
    measured = _threads(size, lambda r: probe(wires[r]))
    assert not [m for m in measured if isinstance(m, BaseException)], measured
    assert all(isinstance(m, Probe) and m.chain_s > 0 and m.ibcast_s > 0 and m.nbytes == PROBE_BYTES for m in measured)
    for r in range(size - 1):  # the chain runs 0, 1, 2, 3 (MPI's broadcast's sends are not windowed)
        assert PROBE_PIECE < wires[r].most[r + 1] <= PROBE_WINDOW, (r, wires[r].most)


def test_the_probe_gives_every_rank_the_same_choice() -> None:
    hub = LoopbackHub(3, timeout=10)
    choices = _threads(3, lambda r: decide(hub.transport(r), "auto", PROBE_MIN_PAYLOAD))
    assert all(c == choices[0] for c in choices), choices
    first = choices[0]
    assert first.probe is not None and first.probe.ibcast_s > 0 and first.probe.chain_s > 0  # type: ignore[attr-defined]
    assert isinstance(transport_for(hub.transport(0), choose("ibcast", 3, 0)), LoopbackTransport)
    assert isinstance(transport_for(hub.transport(0), choose("chain", 3, 0)), ChainTransport)


# ---------------------------------------------------------------------------------------
# The real driver over chains


class RecordedChain(ChainTransport):
    """A chain that records what its rank said at each agreement (as test_transport.Recorded)."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        super().__init__(hub.transport(rank), PIECE)
        self.said: list[bool] = []

    def agree(self, failed: bool, between: Callable[[], None] | None = None) -> bool:
        self.said.append(failed)
        return super().agree(failed, between)


@pytest.mark.parametrize("local", [True, False], ids=["local-source", "downloaded"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_chains_give_every_rank_byte_identical_copies_each_link_carrying_each_byte_once(
    tmp_path: Path, ranks: int, local: bool
) -> None:
    w = world(tmp_path, ranks, local)
    hubs: list[LoopbackHub] = []

    def transports(hub: LoopbackHub, rank: int) -> ChainTransport:
        hubs.append(hub)
        return RecordedChain(hub, rank)

    out = fan_out(w, "run", transports=transports)
    expected = {f.path: d for f, d in zip(w.files, w.data, strict=True)}
    for rank, result in enumerate(out.results):
        assert isinstance(result, FanOutStats), f"rank {rank}: {result!r}"
        assert tree_of(out.dests[rank]) == expected, f"rank {rank}"
        digests = out.drivers[rank].digests
        assert digests and all(digest == md5(w.data[file]) for file, digest in digests.items())
    links: Counter[tuple[int, int]] = Counter()
    for t in w.schedule:
        order = chain_order(t.root, t.receivers, ranks)
        for link in itertools.pairwise(order):
            links[link] += t.length + 1  # the root's intact byte rides with each transfer
    assert hubs[0].link_bytes == dict(links)


@pytest.mark.parametrize("local", [True, False], ids=["local-source", "downloaded"])
@pytest.mark.parametrize("ranks", [3, 4])
def test_the_real_driver_over_windowed_chains_copies_every_byte_within_the_windows(
    tmp_path: Path, ranks: int, local: bool
) -> None:
    """The fan-out's driver over chains that keep a send window (as under Open MPI), sends slow
    to complete and the window held at two pieces (the clock stands still): every copy
    byte-identical, and no rank ever had more than its window and the oldest transfer's one
    send of its own in flight to the next."""
    w = world(tmp_path, ranks, local)
    wires: dict[int, SlowSends] = {}

    def transports(hub: LoopbackHub, rank: int) -> ChainTransport:
        wire = wires[rank] = InterleavingSlowSends(hub, rank)
        return ChainTransport(wire, PIECE, window=True, clock=lambda: 0.0, window_floor=2 * PIECE)

    out = fan_out(w, "run", transports=transports)
    expected = {f.path: d for f, d in zip(w.files, w.data, strict=True)}
    for rank, result in enumerate(out.results):
        assert isinstance(result, FanOutStats), f"rank {rank}: {result!r}"
        assert tree_of(out.dests[rank]) == expected, f"rank {rank}"
    most = max(n for wire in wires.values() for n in wire.most.values())
    assert 2 * PIECE <= most <= 3 * PIECE, {r: dict(wire.most) for r, wire in wires.items()}


# As test_transport's: the middle rank at a sample of its instructions in the default suite;
# at every one, and the last rank at every one, in CI's slow step.
@pytest.mark.parametrize(
    ("victim", "sample"),
    [(1, True), pytest.param(1, False, marks=pytest.mark.slow), pytest.param(2, False, marks=pytest.mark.slow)],
    ids=["1-sampled", "1", "2"],
)
def test_a_failure_at_any_instruction_of_a_chain_ends_every_rank_together(
    tmp_path: Path, victim: int, sample: bool
) -> None:
    """As test_transport's, over chains, the victim in the middle (1) or at the end (2) of the chain."""
    w = world(tmp_path, 3, local=True)
    clean = fan_out(w, "clean", transports=RecordedChain)
    assert all(isinstance(r, FanOutStats) for r in clean.results)
    assert {Post, Write, Agree} <= {type(s) for s in clean.drivers[victim].carried}
    fail_at_every_instruction(w, clean, victim, RecordedChain, sample=sample)


def test_a_rank_that_dies_in_the_middle_of_a_chain_ends_the_others_with_an_error_not_a_hang(tmp_path: Path) -> None:
    w = world(tmp_path, 3, local=True)

    class Dying(ChainTransport):
        posts = 0

        def post(self, data: np.ndarray, root: int, receivers: object) -> Request:
            self.posts += 1
            if self.posts == 3:
                self.wire.die("killed (simulated)")  # type: ignore[attr-defined]
                raise SystemExit(137)  # not an error the driver handles: the rank is gone
            return super().post(data, root, receivers)  # type: ignore[arg-type]

    out = fan_out(
        w,
        "run",
        transports=lambda hub, rank: Dying(hub.transport(rank), PIECE) if rank == 1 else RecordedChain(hub, rank),
    )
    errors = out.errors()
    assert errors[1] is not None
    # Whoever waited for it fails at once; a rank waiting for one of those, in turn (MPI's
    # launcher ends them all together, mpiexec's own doing).
    assert all(isinstance(errors[rank], LoopbackError) for rank in (0, 2)), errors
    assert any("rank 1, which left (killed" in str(errors[rank]) for rank in (0, 2)), errors
    assert_nothing_wrong(w, out)


# ---------------------------------------------------------------------------------------
# Under mpiexec: the whole tool, every method


def _dataset(root: Path) -> dict[str, bytes]:
    files = {
        "model-00001-of-00002.bin": pseudo_random(3 * MiB + 4321, "m1"),
        "model-00002-of-00002.bin": pseudo_random(2 * MiB, "m2"),
        "tok/vocab.json": pseudo_random(70_001, "v"),
        **{f"cfg/{i}.json": pseudo_random(100 * i + 7, f"c{i}") for i in range(6)},
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


@pytest.mark.parametrize("method", ["chain", "ring", "ibcast"])
def test_under_mpiexec_each_method_gives_every_node_the_same_bytes(tmp_path: Path, method: str) -> None:
    files = _dataset(tmp_path / "src")
    dest = str(tmp_path / "d" / "{rank}")
    # Transfers of 4 MiB in 64 KiB pieces: under Open MPI the chain's send window (2 MiB) binds.
    args = [str(tmp_path / "src"), dest, "--fanout", method, "--fanout-piece", "64KiB", "--bcast-chunk", "4MiB"]
    result = run_cli([*args, "--verify", "stream", "--no-progress"], json_path=tmp_path / "r.json")
    assert result.returncode == 0, result.output
    assert_copies(tmp_path / "d", files)
    assert result.json is not None
    expected = "ibcast" if method == "ibcast" else "chain"
    assert result.json["fanout"]["method"] == expected and result.json["fanout"]["reason"] == f"--fanout {method}"
    windowed = expected == "chain" and mpi_flavour() == "openmpi"
    assert result.json["fanout"].get("send_window", False) is windowed, result.json["fanout"]
    via = " via ibcast" if method == "ibcast" else " via chain (64 KiB pieces)"
    assert any(line.startswith("[bcast] ") and line.endswith(via) for line in result.stdout.splitlines()), result.stdout


def test_under_mpiexec_a_streamed_copy_from_the_emulator_goes_round_the_ring(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    """Every rank downloads a share (4 blobs split into 1 MiB shards) and each part goes round
    the ring from its downloader as soon as it lands."""
    container = "r" + uuid.uuid4().hex[:20]
    blobs = {f"w/{i}.bin": pseudo_random(2 * MiB + 999 * i, f"b{i}") for i in range(4)}
    azurite.upload(emulator, container, blobs)
    result = run_cli(
        [emulator.url(container, "w"), str(tmp_path / "d" / "{rank}"), "--fanout", "ring", "--shard-size", "1MiB",
         "--bcast-chunk", "1MiB", "--block-size", "1MiB", "--verify", "stream", "--no-progress"],
        env=emulator.key_env(),
        json_path=tmp_path / "r.json",
    )  # fmt: skip
    assert result.returncode == 0, result.output
    assert_copies(tmp_path / "d", {name[2:]: data for name, data in blobs.items()})
    assert result.json is not None and result.json["overlap"] is True
    assert result.json["fanout"]["method"] == "chain"
    assert result.json["downloaded_bytes"] == sum(len(b) for b in blobs.values())  # read once
    assert len(result.json["plan_loads"]) == 4 and all(result.json["plan_loads"])  # four roots: a ring


def test_under_mpiexec_auto_probes_the_fabric_and_reports_what_it_measured(tmp_path: Path) -> None:
    files = _dataset(tmp_path / "src")
    result = run_cli(
        [str(tmp_path / "src"), str(tmp_path / "d" / "{rank}"), "--no-progress"],
        n=3,
        program=[str(PROBE_ALWAYS)],
        json_path=tmp_path / "r.json",
    )
    assert result.returncode == 0, result.output
    assert_copies(tmp_path / "d", files, ranks=3)
    assert result.json is not None
    fanout = result.json["fanout"]
    assert fanout["reason"].startswith("auto: ") and fanout["method"] in ("chain", "ibcast")
    probe = fanout["probe"]
    assert probe["bytes"] == PROBE_BYTES and probe["ibcast_s"] > 0 and probe["chain_s"] > 0
    measured = Probe(probe["bytes"], ibcast_s=probe["ibcast_s"], chain_s=probe["chain_s"])
    assert fanout["method"] == choose("auto", 3, result.json["broadcast_bytes"], probe=measured).method


def test_a_post_makes_its_own_calls_and_nothing_else_that_could_fail() -> None:
    """The driver posts a transfer whose post raised once more (as a failed root's). A chain's
    post that failed after its messages went out, moving the other chains, would take the
    pair's next tags with that second post and leave its neighbours waiting: so a post only
    posts (the review found this with a failure injected into the progress it used to make)."""
    hub = LoopbackHub(2, timeout=5)

    class Counting(LoopbackTransport):
        progress_calls = 0

        def done(self, request: Request) -> bool:
            Counting.progress_calls += 1
            return super().done(request)

    root, receiver = ChainTransport(Counting(hub, 0), 1024), ChainTransport(Counting(hub, 1), 1024)
    data = [np.full(5000, i, dtype=np.uint8) for i in range(3)]
    got = [np.zeros(5000, dtype=np.uint8) for _ in range(3)]
    sent = [root.post(d, 0, None) for d in data]
    taken = [receiver.post(g, 0, None) for g in got]
    assert Counting.progress_calls == 0
    for request in taken:
        receiver.wait(request)
    for request in sent:
        root.wait(request)
    assert all(bytes(a) == bytes(b) for a, b in zip(data, got, strict=True))


def test_a_report_written_by_a_rank_that_is_no_leader_says_how_the_fan_out_went(tmp_path: Path) -> None:
    """Rank 1 reads the SOURCE and so leads the one node; rank 0, which writes the report, takes
    no part in the fan-out but reports its choice (the allocate stage's agreement brings it)."""
    files = _dataset(tmp_path / "src")
    result = run_cli(
        [str(tmp_path / "src"), str(tmp_path / "one"), "--source-rank", "1", "--no-progress"],
        n=2,
        json_path=tmp_path / "r.json",
    )
    assert result.returncode == 0, result.output
    assert tree_of(tmp_path / "one") == files
    assert result.json is not None and result.json["fanout"]["method"] == "chain", result.json.get("fanout")
    assert any(line.startswith("[bcast] ") and " via chain (" in line for line in result.stdout.splitlines())
