"""The fan-out's real driver in process: ranks as threads over the loopback transport, DESTs on tmp_path.

:class:`FanOutDriver` (its read-ahead, writers, hasher and dispatcher) runs unchanged; only
the calls between the ranks go through :class:`LoopbackTransport` instead of MPI, matched
as MPI matches them and in the most synchronous order MPI allows. Each rank has its own
DEST prepared as the allocate stage prepares a leader's (small files it only receives made
on arrival), and reads what it roots from a local SOURCE or from its own download. Checked:
byte-identical copies and in-flight MD5s; a failure at every instruction a rank carries
out, on one rank, ends every rank with the agreed outcome, no rank hangs, nothing gets a
final name, and every byte reported written is the source's.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from azcp_cluster.core.errors import AzcpError, BroadcastError
from azcp_cluster.core.fanout import CHECK_EVERY, Agree, Hash, Instruction, Post, Read, Write
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.packing import transfer_schedule
from azcp_cluster.core.plan import make_plan
from azcp_cluster.core.schedule import DIRECT_MIN, Extent, Transfer
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.localfs import TEMP_SUFFIX, temp_path
from azcp_cluster.dest.localsource import local_etag
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.fanout.chain import ChainTransport
from azcp_cluster.fanout.driver import FanOutDriver
from azcp_cluster.fanout.events import FanOutStats
from azcp_cluster.fanout.readahead import ReadAhead
from azcp_cluster.fanout.transport import LoopbackError, LoopbackHub, LoopbackTransport, Request, Transport
from azcp_cluster.run.cluster import PeerFailed
from tests.conftest import tree_of

CHUNK = 64 * 1024  # --bcast-chunk: the slots' size
SHARD = 4 * CHUNK  # --shard-size: a larger file is split over the ranks
# One file split over several ranks and slots, files of one slot, small files packed
# several to a slot (made on arrival), nested paths; enough transfers for agreements
# between them (one every fanout.CHECK_EVERY).
SIZES = {
    "big.bin": 32 * CHUNK + 4096 + 123,
    "mid/a.bin": CHUNK,
    "mid/b.bin": 100_000,
    "deep/x/y.bin": 70_001,
    **{f"small/s{i:02d}.txt": 37 * i + 1 for i in range(10)},
}
JOIN_TIMEOUT = 60  # seconds a rank may take before it counts as hung
HUB_TIMEOUT = 20  # seconds a call may wait before the loopback says so


@dataclass
class World:
    """A dataset, its schedule, and how every rank's DEST is prepared."""

    tmp: Path
    ranks: int
    local: bool  # roots read a local SOURCE (else their own download, in their DEST)
    files: list[FileEntry]
    data: list[bytes]
    sources: list[Path]
    schedule: Sequence[Transfer]
    owned: dict[int, list[tuple[int, int, int]]]  # rank -> (file, offset, length) it downloaded


def world(tmp: Path, ranks: int, local: bool) -> World:
    src = tmp / "src"
    files, data, sources = [], [], []
    for path, size in SIZES.items():
        content = pseudo_random(size, path)
        where = src / path
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_bytes(content)
        files.append(FileEntry(name=path, path=path, size=size, etag=local_etag(where.stat(), trusted=False)))
        data.append(content)
        sources.append(where)
    plan = make_plan([f.size for f in files], range(len(files)), ranks, SHARD)
    owned = {r: [(s.file, s.offset, s.length) for s in plan.owned_by(r)] for r in range(ranks)}
    return World(tmp, ranks, local, files, data, sources, transfer_schedule(plan, CHUNK, ranks), owned)


def prepare(w: World, dest: Path, rank: int) -> DestTree:
    """Rank ``rank``'s DEST as the allocate stage leaves a leader's: every file's temporary name
    made, but small files no rank of the node downloads (made on arrival); with a download,
    the bytes this rank downloaded already in place."""
    dest.mkdir(parents=True)
    tree = DestTree(str(dest))
    downloaded = set() if w.local else {file for file, _, _ in w.owned[rank]}
    later = [f.path for i, f in enumerate(w.files) if 0 < f.size < DIRECT_MIN and i not in downloaded]
    tree.prepare_all([(f.path, f.size) for f in w.files], later=later)
    if not w.local:
        for file, offset, length in w.owned[rank]:
            fd = os.open(temp_path(str(dest), w.files[file].path), os.O_WRONLY)
            try:
                os.pwrite(fd, w.data[file][offset : offset + length], offset)
            finally:
                os.close(fd)
    return tree


class Recorded(LoopbackTransport):
    """A loopback end that records what its rank said at each agreement."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        super().__init__(hub, rank)
        self.said: list[bool] = []

    def agree(self, failed: bool, between: Callable[[], None] | None = None) -> bool:
        self.said.append(failed)
        return super().agree(failed, between)


class Counting(FanOutDriver):
    """The real driver, which records every instruction it carries out and fails at the ``fail_at``-th."""

    def __init__(self, *args: Any, fail_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at = fail_at
        self.carried: list[Instruction] = []
        self.agreed_before_failing = -1  # agreements the rank had joined when its failure came

    def _carry_out(self, run: Any, step: Instruction) -> Any:
        self.carried.append(step)
        if len(self.carried) - 1 == self.fail_at:
            self.agreed_before_failing = len(getattr(self.transport, "said", ()))
            raise BroadcastError(f"injected at instruction {self.fail_at} ({type(step).__name__})", rank=self.rank)
        return super()._carry_out(run, step)


@dataclass
class Outcome:
    """What every rank's run ended with."""

    results: list[FanOutStats | BaseException | None]
    drivers: list[Counting]
    dests: list[Path]
    written: list[list[tuple[int, int, int]]] = field(default_factory=list)

    def errors(self) -> list[BaseException | None]:
        return [r if isinstance(r, BaseException) else None for r in self.results]


def fan_out(
    w: World,
    name: str,
    *,
    fail_at: dict[int, int] | None = None,
    transports: Callable[[LoopbackHub, int], Transport] | None = None,
    failed: dict[int, AzcpError] | None = None,
    schedule: Sequence[Transfer] | None = None,
    pipeline: int = 3,
) -> Outcome:
    """Every rank's fan-out of ``w`` at once (one thread each); renamed, as the stage does, only
    if every rank succeeded. A rank still running after JOIN_TIMEOUT fails the test: it hung."""
    hub = LoopbackHub(w.ranks, timeout=HUB_TIMEOUT)
    results: list[FanOutStats | BaseException | None] = [None] * w.ranks
    written: list[list[tuple[int, int, int]]] = [[] for _ in range(w.ranks)]
    dests = [w.tmp / name / str(rank) for rank in range(w.ranks)]
    trees = [prepare(w, dests[rank], rank) for rank in range(w.ranks)]
    schedule = schedule if schedule is not None else w.schedule
    writers = [
        NodeWriter(
            w.files,
            trees[rank],
            2,
            on_arrival={i for i in range(len(w.files)) if _deferred(w, rank, i)},  # what prepare() deferred
            journal=lambda file, offset, length, crc, source, rank=rank: written[rank].append((file, offset, length)),  # type: ignore[misc]
        )
        for rank in range(w.ranks)
    ]
    drivers = [
        Counting(
            transports(hub, rank) if transports is not None else Recorded(hub, rank),
            w.files,
            trees[rank],
            max(t.length for t in schedule),
            writers[rank],
            pipeline=pipeline,
            writers=2,
            verify=True,
            source_of=(lambda i: str(w.sources[i])) if w.local else None,
            fail_at=(fail_at or {}).get(rank),
        )
        for rank in range(w.ranks)
    ]

    def one(rank: int) -> None:
        try:
            results[rank] = drivers[rank].run(schedule, failed=(failed or {}).get(rank))
        except BaseException as exc:
            results[rank] = exc
        finally:
            hub.leave(rank, "its fan-out ended")

    threads = [threading.Thread(target=one, args=(rank,), name=f"rank-{rank}", daemon=True) for rank in range(w.ranks)]
    for thread in threads:
        thread.start()
    for rank, thread in enumerate(threads):
        thread.join(JOIN_TIMEOUT)
        assert not thread.is_alive(), f"rank {rank} hung (fail_at={fail_at})"
    for writer in writers:  # the run's to close, after their queued writes
        writer.close()
    if all(isinstance(r, FanOutStats) for r in results):  # the stage's agreement, then its rename
        for tree in trees:
            tree.rename_all([f.path for f in w.files])
    for tree in trees:
        tree.close()
    return Outcome(results, drivers, dests, written)


def _deferred(w: World, rank: int, index: int) -> bool:
    size = w.files[index].size
    return 0 < size < DIRECT_MIN and (w.local or index not in {f for f, _, _ in w.owned[rank]})


def md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode("ascii")


def assert_nothing_wrong(w: World, out: Outcome) -> None:
    """No final name anywhere, and every range a writer reported written holds the source's bytes."""
    for rank, dest in enumerate(out.dests):
        names = tree_of(dest)
        finals = [name for name in names if not name.endswith(TEMP_SUFFIX)]
        assert not finals, f"rank {rank} has final names {finals}"
        for file, offset, length in out.written[rank]:
            with open(temp_path(str(dest), w.files[file].path), "rb") as fh:
                fh.seek(offset)
                got = fh.read(length)
            assert got == w.data[file][offset : offset + length], (
                f"rank {rank} wrote wrong bytes of {w.files[file].path}"
            )


# ---------------------------------------------------------------------------------------
# The loopback transport itself


def _buffer(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), dtype=np.uint8)


def test_a_broadcast_completes_once_every_rank_posted_it() -> None:
    hub = LoopbackHub(3, timeout=5)
    ends = [hub.transport(r) for r in range(3)]
    buffers = [_buffer(b"hello"), _buffer(b"\0" * 5), _buffer(b"\0" * 5)]
    first = ends[0].post(buffers[0], 0, None)
    second = ends[1].post(buffers[1], 0, None)
    assert not ends[0].test(first) and not ends[1].test(second) and buffers[1].tobytes() == b"\0" * 5
    third = ends[2].post(buffers[2], 0, None)
    assert all(end.test(req) for end, req in zip(ends, (first, second, third), strict=True))
    assert [b.tobytes() for b in buffers] == [b"hello"] * 3


def test_point_to_point_transfers_match_in_order_per_pair() -> None:
    hub = LoopbackHub(3, timeout=5)
    root, one, two = (hub.transport(r) for r in range(3))
    sends = [root.post(_buffer(b"first"), 0, (1, 2)), root.post(_buffer(b"again"), 0, (2,))]
    into = [_buffer(b"\0" * 5) for _ in range(3)]
    got_one = one.post(into[0], 0, (1, 2))
    assert one.test(got_one) and not root.test(sends[0])  # rank 2 has not received yet
    got_two = [two.post(into[1], 0, (1, 2)), two.post(into[2], 0, (2,))]
    root.wait(sends[0])
    root.wait(sends[1])
    assert all(two.test(r) for r in got_two)
    assert [b.tobytes() for b in into] == [b"first", b"first", b"again"]


def test_an_agreement_is_the_or_of_every_rank() -> None:
    hub = LoopbackHub(3, timeout=5)
    answers: list[bool] = [False] * 3

    def agree(rank: int, failed: bool) -> None:
        answers[rank] = hub.transport(rank).agree(failed)

    threads = [threading.Thread(target=agree, args=(r, r == 2)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert answers == [True, True, True]


@pytest.mark.parametrize("chained", [False, True], ids=["loopback", "chain"])
def test_a_rank_waiting_in_an_agreement_runs_between_until_the_last_joins(chained: bool) -> None:
    # What a rank does meanwhile (FanOutDriver: tell the others of a signal at once) runs while
    # it waits, not once the last rank has joined.
    hub = LoopbackHub(2, timeout=5)
    calls: list[float] = []
    answers: list[bool] = [False, False]

    def transport(rank: int) -> Transport:
        return ChainTransport(hub.transport(rank), 1024) if chained else hub.transport(rank)

    def first() -> None:
        answers[0] = transport(0).agree(False, lambda: calls.append(time.monotonic()))

    waiter = threading.Thread(target=first)
    waiter.start()
    time.sleep(0.3)
    joined = time.monotonic()
    answers[1] = transport(1).agree(True)
    waiter.join(10)
    assert answers == [True, True]
    assert calls and calls[0] < joined and len(calls) > 10


def test_mismatched_calls_a_lost_rank_and_a_wait_too_long_raise_instead_of_hanging() -> None:
    hub = LoopbackHub(2, timeout=0.2)
    zero, one = hub.transport(0), hub.transport(1)
    zero.post(_buffer(b"abc"), 0, None)
    with pytest.raises(LoopbackError, match="from 0 of 3 bytes"):
        one.post(_buffer(b"abcd"), 0, None)  # the same collective, another length
    hub = LoopbackHub(2, timeout=0.2)
    zero, one = hub.transport(0), hub.transport(1)
    request = zero.post(_buffer(b"abc"), 0, None)
    with pytest.raises(LoopbackError, match="did not complete"):
        zero.wait(request)
    one.die()
    with pytest.raises(LoopbackError, match="for rank 1, which left"):
        zero.test(request)
    with pytest.raises(LoopbackError, match="after it left"):
        one.agree(False)


# ---------------------------------------------------------------------------------------
# The real driver


@pytest.mark.parametrize("local", [True, False], ids=["local-source", "downloaded"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_rank_ends_with_byte_identical_copies(tmp_path: Path, ranks: int, local: bool) -> None:
    w = world(tmp_path, ranks, local)
    assert any(len(t.extents) > 2 for t in w.schedule), "no slot packs small files"
    assert len({t.root for t in w.schedule if t.extents[0].file == 0}) > 1, "the big file is not split over ranks"
    out = fan_out(w, "run")
    expected = {f.path: d for f, d in zip(w.files, w.data, strict=True)}
    for rank, result in enumerate(out.results):
        assert isinstance(result, FanOutStats), f"rank {rank}: {result!r}"
        assert tree_of(out.dests[rank]) == expected, f"rank {rank}"
        assert result.chunks == sum(1 for t in w.schedule if t.involves(rank))
        digests = out.drivers[rank].digests
        assert digests, "nothing was hashed in flight"
        assert all(digest == md5(w.data[file]) for file, digest in digests.items())
    assert not any(d.changed for d in out.drivers)


# Rank 0 as the victim, failing at a sample of its instructions (every kind's first, both
# sides of every agreement, the last few, every SAMPLE-th), in the default suite; rank 0 at
# every one and rank 1 at every one (about 13 s each) in CI's slow step.
@pytest.mark.parametrize(
    ("victim", "sample"),
    [(0, True), pytest.param(0, False, marks=pytest.mark.slow), pytest.param(1, False, marks=pytest.mark.slow)],
    ids=["0-sampled", "0", "1"],
)
def test_a_failure_at_any_instruction_ends_every_rank_together(tmp_path: Path, victim: int, sample: bool) -> None:
    """For every instruction k the victim carries out in a whole run, a run where carrying out
    its k-th fails: the victim ends with that error; every other rank with PeerFailed if an
    agreement followed (else the failure came after the last one, in a write of the last
    transfers, and the stage's own agreement stops them, unless a slot the victim sent
    unfilled told them); no rank hangs, nothing is renamed, nothing wrong is written."""
    w = world(tmp_path, 3, local=True)
    assert len(w.schedule) > 2 * CHECK_EVERY, "too few transfers for agreements between them"
    clean = fan_out(w, "clean")
    assert all(isinstance(r, FanOutStats) for r in clean.results)
    assert {Read, Post, Write, Hash, Agree} <= {type(s) for s in clean.drivers[victim].carried}
    fail_at_every_instruction(w, clean, victim, sample=sample)


# With ``sample``, one instruction in this many, besides those sampled() always takes.
SAMPLE = 4


def sampled(steps: Sequence[Instruction]) -> list[int]:
    """The instructions a sampled run fails at: the first of each kind, the one before, at and
    after each agreement (a failure reported there or just missed), the last three (after the
    last agreement) and every SAMPLE-th."""
    picked = set(range(0, len(steps), SAMPLE)) | set(range(max(0, len(steps) - 3), len(steps)))
    seen: set[type] = set()
    for k, step in enumerate(steps):
        if type(step) not in seen:
            seen.add(type(step))
            picked.add(k)
        if isinstance(step, Agree):
            picked |= {k - 1, k, k + 1}
    return sorted(k for k in picked if 0 <= k < len(steps))


def fail_at_every_instruction(
    w: World,
    clean: Outcome,
    victim: int,
    transports: Callable[[LoopbackHub, int], Transport] | None = None,
    *,
    sample: bool = False,
) -> None:
    """For each instruction k the victim carried out in ``clean`` (or those :func:`sampled`
    picks), a run failing at its k-th: the victim ends with that error, having said so at every
    agreement after it; every other rank with PeerFailed, or with nothing if no agreement
    followed; nothing wrong written."""
    steps = clean.drivers[victim].carried
    for k in sampled(steps) if sample else range(len(steps)):
        step = steps[k]
        out = fan_out(w, f"k{k}", fail_at={victim: k}, transports=transports)
        errors = out.errors()
        mine = errors[victim]
        assert isinstance(mine, BroadcastError) and f"injected at instruction {k} " in str(mine), (k, step, mine)
        agreed = any(isinstance(s, Agree) for s in out.drivers[victim].carried[k:])
        said = out.drivers[victim].transport.said  # type: ignore[attr-defined]
        assert all(said[out.drivers[victim].agreed_before_failing :]), (k, step, "the victim hid its failure")
        for rank, error in enumerate(errors):
            if rank != victim:
                # Without an agreement after it, a receiver may still learn of it from a slot
                # the victim sent unfilled; never of anything else.
                assert isinstance(error, PeerFailed) or (error is None and not agreed), (k, step, rank, error)
        assert_nothing_wrong(w, out)


def test_a_root_whose_read_fails_sends_nothing_anyone_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of the read-ahead thread fails on the big file's second root: its slot goes out
    with ``intact`` unset, and no receiver writes a byte of it."""
    w = world(tmp_path, 3, local=True)
    root = next(t.root for t in w.schedule if t.extents[0].file == 0 and t.root != 0)
    read = ReadAhead.read

    def failing(self: ReadAhead, transfer: Transfer, buffer: np.ndarray) -> None:
        if self.rank == root and transfer.extents[0].file == 0:
            buffer[: transfer.length] = 7  # what a torn read leaves in the slot
            raise OSError(5, "Input/output error (simulated)")
        read(self, transfer, buffer)

    monkeypatch.setattr(ReadAhead, "read", failing)
    out = fan_out(w, "run")
    errors = out.errors()
    assert isinstance(errors[root], AzcpError) and "Input/output error" in str(errors[root])
    assert all(isinstance(e, PeerFailed) for r, e in enumerate(errors) if r != root)
    assert_nothing_wrong(w, out)


class Flaky:
    """A transport whose ``calls``-th post or agreement raises once, before it reaches the others."""

    def __init__(self, inner: LoopbackTransport, calls: int) -> None:
        self.inner = inner
        self.left = calls

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _count(self) -> None:
        self.left -= 1
        if self.left == 0:
            raise OSError(104, "Connection reset by peer (simulated)")

    def post(self, data: np.ndarray, root: int, receivers: Sequence[int] | None) -> Request:
        self._count()
        return self.inner.post(data, root, receivers)

    def test(self, request: Request) -> bool:
        return self.inner.test(request)

    def wait(self, request: Request) -> None:
        self.inner.wait(request)

    def agree(self, failed: bool, between: Callable[[], None] | None = None) -> bool:
        self._count()
        return self.inner.agree(failed, between)


@pytest.mark.parametrize("calls", [1, 2, 5])
def test_a_transport_call_that_fails_once_stops_every_rank(tmp_path: Path, calls: int) -> None:
    w = world(tmp_path, 2, local=False)

    def transports(hub: LoopbackHub, rank: int) -> Transport:
        return Flaky(hub.transport(rank), calls) if rank == 1 else hub.transport(rank)

    out = fan_out(w, "run", transports=transports)
    errors = out.errors()
    assert isinstance(errors[1], AzcpError) and "Connection reset" in str(errors[1]), errors
    assert isinstance(errors[0], PeerFailed), errors
    assert_nothing_wrong(w, out)


class LateToAgree(Recorded):
    """A rank that joins each agreement ``late`` seconds after it is asked to (a streaming root
    still downloading the bytes of the transfers before it); the times it was asked and joined."""

    def __init__(self, hub: LoopbackHub, rank: int, late: float) -> None:
        super().__init__(hub, rank)
        self.late = late
        self.asked: list[float] = []
        self.joined: list[float] = []

    def iagree(self, failed: bool) -> Request:  # the driver's agreements (alone or through a chain) start here
        self.asked.append(time.monotonic())
        time.sleep(self.late)
        self.joined.append(time.monotonic())
        return super().iagree(failed)


@pytest.mark.parametrize("chain", [False, True], ids=["ibcast", "chain"])
def test_a_rank_waiting_in_an_agreement_writes_what_it_received_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chain: bool
) -> None:
    """The transfers posted before an agreement complete while a rank waits there for a late one,
    and go to its writers then (so its journal records them), not once the last rank has joined:
    a stopped run's receivers kept nothing of a streamed copy's first seconds."""
    w = world(tmp_path, 2, local=True)
    ends: dict[int, LateToAgree] = {}

    def transports(hub: LoopbackHub, rank: int) -> Transport:
        end = ends[rank] = LateToAgree(hub, rank, late=0.5 if rank == 0 else 0.0)
        return ChainTransport(end, 4096) if chain else end

    handed: list[tuple[str, float]] = []  # (the driver's thread, when) of every write handed to a writer
    real = NodeWriter.write_extents

    def write_extents(self: NodeWriter, *args: Any, **kwargs: Any) -> None:
        handed.append((threading.current_thread().name, time.monotonic()))
        real(self, *args, **kwargs)

    monkeypatch.setattr(NodeWriter, "write_extents", write_extents)
    out = fan_out(w, "run", transports=transports)
    assert all(isinstance(result, FanOutStats) for result in out.results), out.results
    late, waiting = ends[0], ends[1]
    assert len(late.joined) == len(waiting.asked) >= 2  # the checks, then the last after the last post
    meanwhile = [
        at for thread, at in handed if thread == "rank-1" and any(
            asked < at < joined for asked, joined in zip(waiting.asked, late.joined, strict=True)
        )
    ]  # fmt: skip
    assert meanwhile, "rank 1 handed nothing to its writers while it waited for rank 0"
    expected = {f.path: d for f, d in zip(w.files, w.data, strict=True)}
    assert all(tree_of(dest) == expected for dest in out.dests)


def test_a_rank_failed_before_its_first_transfer_past_an_agreement_still_joins_it(tmp_path: Path) -> None:
    """Rank 2 failed before the fan-out began (its download could not be set up) and takes no
    part in the first 20 transfers: the agreement its failure asks for at once is carried out."""
    w = world(tmp_path, 3, local=True)
    big = 0
    early = [
        Transfer(seq, 0, (1,), (Extent(big, seq * 4096, 4096, 0, last_of_file=False),), everyone=False)
        for seq in range(20)
    ]
    last = Transfer(20, 0, (1, 2), (Extent(big, 20 * 4096, 4096, 0, last_of_file=True),), everyone=True)
    failed = {2: BroadcastError("the download could not be set up (simulated)", rank=2)}
    out = fan_out(w, "run", schedule=[*early, last], failed=failed)
    errors = out.errors()
    assert errors[2] is failed[2]
    assert isinstance(errors[0], PeerFailed) and isinstance(errors[1], PeerFailed), errors


def test_a_failed_root_counts_none_of_the_transfers_it_posts_empty(tmp_path: Path) -> None:
    """A root that failed goes on posting its transfers, unread, until the agreement (so nobody
    waits in a collective): their bytes are no one's, and neither its figures (the stopped run's
    [bcast] line) nor its receivers' count them (a report said 96 MiB sent of 72 downloaded)."""
    w = world(tmp_path, 2, local=True)
    failed = {0: BroadcastError("the download could not be set up (simulated)", rank=0)}
    out = fan_out(w, "run", failed=failed)
    assert out.errors()[0] is failed[0] and isinstance(out.errors()[1], PeerFailed), out.errors()
    posted = [step for step in out.drivers[0].carried if isinstance(step, Post)]
    assert any(w.schedule[step.seq].root == 0 for step in posted), "rank 0 posted nothing of its own"
    stats = out.drivers[0].stats  # what it counts is what rank 1 sent it, not one of its own
    assert stats.sent_bytes == 0 and stats.chunks <= sum(1 for t in w.schedule if t.root == 1), stats
    of_rank_0 = {(e.file, e.offset) for t in w.schedule if t.root == 0 for e in t.extents}
    assert not [r for r in out.written[1] if r[:2] in of_rank_0], "rank 1 wrote bytes rank 0 never read"


def test_a_rank_that_dies_ends_the_others_with_an_error_not_a_hang(tmp_path: Path) -> None:
    w = world(tmp_path, 3, local=True)

    class Dying(LoopbackTransport):
        posts = 0

        def post(self, data: np.ndarray, root: int, receivers: Sequence[int] | None) -> Request:
            self.posts += 1
            if self.posts == 3:
                self.die("killed (simulated)")
                raise SystemExit(137)  # not an error the driver handles: the rank is gone
            return super().post(data, root, receivers)

    out = fan_out(w, "run", transports=lambda hub, rank: Dying(hub, rank) if rank == 1 else hub.transport(rank))
    errors = out.errors()
    assert errors[1] is not None  # gone (its own end may meet the others gone too)
    for rank in (0, 2):
        assert isinstance(errors[rank], LoopbackError) and "rank 1, which left" in str(errors[rank]), errors
