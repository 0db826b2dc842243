"""The fan-out state machine (azcp_cluster/core/fanout.py), in process, without MPI or threads.

A small simulator plays every rank's machine against the others: a broadcast completes
once every rank has posted it, a point-to-point transfer once its root and that receiver
have, an agreement once every rank has asked for it; reads, writes, landings and failures
happen in an order drawn at random. It checks the rules the module states: order, at most
``depth`` in flight, no slot reused while anything reads it, every extent written where it
is needed exactly once, and that a failure anywhere stops every rank at the same agreement.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.errors import BroadcastError
from azcp_cluster.core.fanout import MAKE_AHEAD, Agree, Drain, FanOut, Finish, Hash, Instruction, Post, Read, Write
from azcp_cluster.core.packing import transfer_schedule
from azcp_cluster.core.plan import make_plan
from azcp_cluster.core.schedule import Extent, Transfer


@dataclass
class Rank:
    machine: FanOut
    posted: list[int] = field(default_factory=list)  # seqs, in posting order
    inflight: deque[int] = field(default_factory=deque)
    reads: list[Read] = field(default_factory=list)  # pending thread work
    jobs: list[Write | Hash] = field(default_factory=list)
    agreeing: Agree | None = None
    finish: Finish | None = None
    written: list[tuple[int, int, int]] = field(default_factory=list)  # (file, offset, length)
    hashed: list[tuple[int, int]] = field(default_factory=list)
    slot_users: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    completed: list[int] = field(default_factory=list)
    intact: list[int] = field(default_factory=list)  # completed with their root's bytes


class Sim:
    """Every rank's machine, and the world they share."""

    def __init__(
        self,
        schedule: Sequence[Transfer],
        ranks: int,
        depth: int,
        writers: int,
        rng: random.Random,
        *,
        streaming: bool = False,
        check_every: int = 4,
    ) -> None:
        self.schedule = schedule
        self.rng = rng
        self.depth = depth
        self.streaming = streaming
        self.ranks = [
            Rank(
                FanOut(
                    r,
                    schedule,
                    depth,
                    writes=lambda t, e, r=r: t.root != r,  # type: ignore[misc]
                    hashes=lambda f: f % 2 == 0,
                    writers=writers,
                    waits_landing=(lambda seq: True) if streaming else (lambda seq: False),
                    check_every=check_every,
                )
            )
            for r in range(ranks)
        ]
        self.to_land = {t.seq for t in schedule} if streaming else set()
        self.agreements: list[list[bool]] = []  # per agreement: each rank's flag
        self.failed_at = -1  # agreements held before the injected failure
        self.intact: dict[int, bool] = {}  # seq -> the byte its root posted it with

    def apply(self, r: int, instructions: list[Instruction]) -> None:
        rank = self.ranks[r]
        for step in instructions:
            assert rank.finish is None, "instruction after Finish"
            if isinstance(step, Read):
                assert self.schedule[step.seq].root == r
                self.claim(rank, step.slot, f"read {step.seq}")
                rank.reads.append(step)
            elif isinstance(step, Post):
                assert not rank.posted or step.seq > rank.posted[-1], "posts out of schedule order"
                assert self.schedule[step.seq].involves(r)
                rank.posted.append(step.seq)
                rank.inflight.append(step.seq)
                if self.schedule[step.seq].root == r:
                    self.intact[step.seq] = step.intact
                assert len(rank.inflight) <= self.depth, "more than depth in flight"
                self.claim(rank, step.slot, f"post {step.seq}")
            elif isinstance(step, Write | Hash):
                rank.jobs.append(step)
                self.claim(rank, step.slot, f"job {step.seq} {id(step)}")
            elif isinstance(step, Agree):
                assert rank.agreeing is None
                rank.agreeing = step
            elif isinstance(step, Drain):
                for seq in rank.inflight:
                    self.release(rank, seq, "post")
                rank.inflight.clear()
            else:
                rank.finish = step

    def claim(self, rank: Rank, slot: int, what: str) -> None:
        users = rank.slot_users[slot]
        seq = what.split()[1]
        others = {u for u in users if u.split()[1] != seq}
        assert not others, f"slot {slot} reused for {what} while {others}"
        users.add(what)

    def release(self, rank: Rank, seq: int, prefix: str, tag: str = "") -> None:
        for users in rank.slot_users.values():
            for u in list(users):
                if u.startswith(f"{prefix} {seq}") and (not tag or u.endswith(tag)):
                    users.discard(u)

    def complete_call(self, r: int) -> bool:
        """Retire rank r's oldest call if MPI would have completed it."""
        rank = self.ranks[r]
        if not rank.inflight:
            return False
        seq = rank.inflight[0]
        transfer = self.schedule[seq]
        if transfer.everyone:
            needed = range(len(self.ranks))
        elif transfer.root == r:
            needed = [r, *transfer.receivers]
        else:
            needed = [r, transfer.root]
        if not all(seq in self.ranks[o].posted for o in needed):
            return False
        rank.inflight.popleft()
        rank.completed.append(seq)
        self.release(rank, seq, "post")
        intact = self.intact[seq]
        if intact:
            rank.intact.append(seq)
        self.apply(r, rank.machine.call_done(intact))
        return True

    def step(self, fail: tuple[int, int] | None, moves: int) -> bool:
        """One random event; False when nothing can happen any more."""
        choices = []
        for r, rank in enumerate(self.ranks):
            if rank.finish is not None and not rank.jobs and not rank.reads:
                continue
            if rank.reads:
                choices.append(("read", r))
            if rank.jobs:
                choices.append(("job", r))
            if rank.inflight:
                choices.append(("call", r))
        if self.to_land:
            choices.append(("land", -1))
        if all(rank.agreeing is not None or rank.finish is not None for rank in self.ranks) and any(
            rank.agreeing is not None for rank in self.ranks
        ):
            choices.append(("agree", -1))
        if fail is not None and moves == fail[1]:
            r = fail[0]
            if self.ranks[r].finish is None:
                # A rank already in an agreement said "no failure" there: the next one says it.
                self.failed_at = len(self.agreements) + (self.ranks[r].agreeing is not None)
                self.apply(r, self.ranks[r].machine.failed(BroadcastError("injected", rank=r)))
            return True
        if not choices:
            return False
        kind, r = self.rng.choice(choices)
        if kind == "read":
            rank = self.ranks[r]
            job = rank.reads.pop(self.rng.randrange(len(rank.reads)))
            self.release(rank, job.seq, "read")
            self.apply(r, rank.machine.read_done(job.seq))
        elif kind == "job":
            rank = self.ranks[r]
            pick = self.rng.randrange(len(rank.jobs))
            if isinstance(rank.jobs[pick], Hash):  # one hasher thread: its jobs in order
                pick = next(i for i, j in enumerate(rank.jobs) if isinstance(j, Hash))
            job = rank.jobs.pop(pick)
            for e in job.extents:
                (rank.written if isinstance(job, Write) else rank.hashed).append(
                    (e.file, e.offset, e.length) if isinstance(job, Write) else (e.file, e.offset)
                )
            self.release(rank, job.seq, "job", str(id(job)))
            self.apply(r, rank.machine.write_done(job.seq))
        elif kind == "call":
            self.complete_call(r)
        elif kind == "land":
            seq = self.rng.choice(sorted(self.to_land))
            self.to_land.discard(seq)
            root = self.schedule[seq].root
            if self.ranks[root].finish is None:
                self.apply(root, self.ranks[root].machine.landed(seq))
        else:
            flags = [rank.agreeing.failed if rank.agreeing else False for rank in self.ranks]
            assert all(rank.agreeing is not None for rank in self.ranks), "an agreement some rank never joins"
            self.agreements.append(flags)
            for r2, rank in enumerate(self.ranks):
                rank.agreeing = None
                self.apply(r2, rank.machine.agreed(any(flags)))
        return True

    def run(self, fail: tuple[int, int] | None = None) -> None:
        for r in range(len(self.ranks)):
            self.apply(r, self.ranks[r].machine.start())
        moves = 0
        while self.step(fail, moves):
            moves += 1
            assert moves < 200_000
        unfinished = [r for r, rank in enumerate(self.ranks) if rank.finish is None]
        assert not unfinished, f"ranks {unfinished} never finished (deadlock)"


def _schedule(seed: int, ranks: int, subset: bool) -> Sequence[Transfer]:
    rng = random.Random(seed)
    sizes = [rng.choice([0, rng.randrange(1, 5000), rng.randrange(1, 200_000)]) for _ in range(rng.randrange(1, 30))]
    plan = make_plan(sizes, range(len(sizes)), ranks, 50_000)
    receivers = None
    if subset:

        def receivers(file: int, root: int) -> tuple[int, ...]:
            return tuple(r for r in range(ranks) if (file + r) % 3 != 0)

    return transfer_schedule(plan, 16_384, ranks, receivers_of=receivers)


@given(
    seed=st.integers(0, 10_000),
    ranks=st.integers(1, 4),
    depth=st.integers(1, 4),
    writers=st.integers(1, 3),
    subset=st.booleans(),
    streaming=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_every_rank_finishes_and_writes_what_it_needs(
    seed: int, ranks: int, depth: int, writers: int, subset: bool, streaming: bool
) -> None:
    schedule = _schedule(seed, ranks, subset)
    sim = Sim(schedule, ranks, depth, writers, random.Random(seed), streaming=streaming)
    sim.run()
    for r, rank in enumerate(sim.ranks):
        assert rank.finish == Finish(None, False)
        mine = [t for t in schedule if t.involves(r)]
        assert rank.completed == [t.seq for t in mine]  # completed in schedule order
        want = sorted((e.file, e.offset, e.length) for t in mine if t.root != r for e in t.extents)
        assert sorted(rank.written) == want  # every extent it needs, exactly once
        hashed = [(e.file, e.offset) for t in mine for e in t.extents if e.file % 2 == 0]
        assert rank.hashed == hashed  # the hasher sees extents in schedule order
        assert all(not users for users in rank.slot_users.values())
    # Every rank joined every agreement, none failed.
    assert all(not any(flags) and len(flags) == ranks for flags in sim.agreements)
    assert len(sim.agreements) == max(0, (len(schedule) - 1) // 4)


@pytest.mark.parametrize("columns", [True, False])
def test_a_long_schedule_holds_few_transfers_at_once(columns: bool) -> None:
    """Some 1,200 transfers: each rank makes its items (and their transfers) as their turn comes
    and drops them once done, from the schedule's columns or from a plain list alike."""
    plan = make_plan([5_000] * 3_000, range(3_000), 3, 1 << 20)
    schedule = transfer_schedule(plan, 12_288, 3)
    assert len(schedule) > 10 * MAKE_AHEAD
    listed = schedule if columns else list(schedule)
    depth = 3
    sim = Sim(listed, 3, depth, 2, random.Random(5), streaming=True)
    peak = 0
    apply = sim.apply

    def counting(r: int, instructions: list[Instruction]) -> None:
        nonlocal peak
        apply(r, instructions)
        peak = max(peak, *(len(rank.machine.live) for rank in sim.ranks))

    sim.apply = counting  # type: ignore[method-assign]
    sim.run()
    assert 0 < peak <= 2 * depth + MAKE_AHEAD
    for r, rank in enumerate(sim.ranks):
        assert rank.finish == Finish(None, False) and not rank.machine.live
        mine = [t for t in schedule if t.involves(r)]
        assert rank.completed == [t.seq for t in mine]
        assert sorted(rank.written) == sorted(
            (e.file, e.offset, e.length) for t in mine if t.root != r for e in t.extents
        )


@given(
    seed=st.integers(0, 10_000),
    ranks=st.integers(1, 4),
    depth=st.integers(1, 4),
    subset=st.booleans(),
    streaming=st.booleans(),
    when=st.integers(0, 400),
    who=st.integers(0, 3),
)
@settings(max_examples=400, deadline=None)
def test_a_failure_at_any_point_stops_every_rank(
    seed: int, ranks: int, depth: int, subset: bool, streaming: bool, when: int, who: int
) -> None:
    schedule = _schedule(seed, ranks, subset)
    who %= ranks
    sim = Sim(schedule, ranks, depth, 2, random.Random(seed), streaming=streaming)
    sim.run(fail=(who, when))
    failed = sim.ranks[who].finish
    assert failed is not None
    if failed.error is None:
        # The failure came after the rank had finished: nothing to stop.
        assert all(rank.finish == Finish(None, False) for rank in sim.ranks)
        return
    assert failed.error.message == "injected" and not failed.peer
    later = sim.agreements[sim.failed_at :]
    for r, rank in enumerate(sim.ranks):
        assert not rank.inflight  # drained: no call left in flight
        # Never a byte the failed root did not fill: only transfers it posted intact are written.
        genuine = sorted((e.file, e.offset, e.length) for t in schedule if t.seq in rank.intact for e in t.extents)
        assert set(rank.written) <= set(genuine), "a receiver wrote a slot its failed root never filled"
        if r == who:
            continue
        if later:
            # The next agreement saw the failure, and every other rank stopped there.
            assert later[0][who] and len(later) == 1
            assert rank.finish == Finish(None, True)
        else:
            # It came after the last agreement: the others finish, the stage's end tells them;
            # one that received a slot a failed root never filled (the failed rank's, or a
            # slot of a rank that learnt it so) knows already.
            unfilled = any(seq not in rank.intact for seq in rank.completed if schedule[seq].root != r)
            assert rank.finish == Finish(None, unfilled)


def test_a_failed_rank_reads_and_writes_nothing_more_but_still_posts() -> None:
    plan = make_plan([10_000] * 12, range(12), 2, 1 << 20)
    schedule = transfer_schedule(plan, 4096, 2, pack=False)
    machine = FanOut(0, schedule, 2, writes=lambda t, e: t.root != 0, check_every=100)
    out = machine.start()
    machine.failed(BroadcastError("disk on fire"))
    for step in out:
        if isinstance(step, Read):
            out += machine.read_done(step.seq)
    posts = [s for s in out if isinstance(s, Post)]
    assert posts
    later: list[Instruction] = []
    for _ in range(len(posts)):
        later += machine.call_done()
    assert not any(isinstance(s, Read | Write | Hash) for s in later)
    assert any(isinstance(s, Post) for s in later)


def test_streaming_root_waits_for_its_bytes() -> None:
    plan = make_plan([4096, 4096], range(2), 1, 1 << 20)
    schedule = transfer_schedule(plan, 4096, 2)
    machine = FanOut(0, schedule, 4, writes=lambda t, e: False, waits_landing=lambda seq: True)
    assert machine.start() == []  # nothing to read before the bytes land, nothing to post
    assert machine.landed(1) == [Read(1, 1)]  # read at once...
    assert machine.landed(0) == [Read(0, 0)]
    assert machine.read_done(1) == []  # ...but never posted before the first
    assert machine.read_done(0) == [Post(0, 0), Post(1, 1)]


def test_a_peer_failure_releases_a_root_waiting_for_bytes() -> None:
    plan = make_plan([4096], range(1), 1, 1 << 20)
    schedule = transfer_schedule(plan, 4096, 2)
    machine = FanOut(0, schedule, 4, writes=lambda t, e: False, waits_landing=lambda seq: True)
    assert machine.start() == []
    assert machine.failed(None) == [Post(0, 0, intact=False)]  # posted unread: it says so
    assert machine.call_done() == [Finish(None, True)]


def test_a_receiver_writes_nothing_its_root_never_filled() -> None:
    """The root failed and posted a slot it never read (zeros, or an earlier transfer's bytes)
    before this rank heard of it: the byte sent with it stops the writes, and the rank knows."""
    plan = make_plan([4096, 4096], range(2), 1, 1 << 20)
    schedule = transfer_schedule(plan, 4096, 2, pack=False)
    machine = FanOut(1, schedule, 2, writes=lambda t, e: True, check_every=100)
    assert machine.start() == [Post(0, 0), Post(1, 1)]
    assert [type(s) for s in machine.call_done(intact=True)] == [Write]  # a genuine one is written
    assert machine.call_done(intact=False) == []  # the failed root's is not
    assert machine.peer and machine.failing


def test_a_rank_in_no_transfer_still_joins_every_agreement() -> None:
    plan = make_plan([4096] * 40, range(40), 1, 1 << 20)
    schedule = transfer_schedule(plan, 4096, 3, receivers_of=lambda f, r: (1,), pack=False)
    machine = FanOut(2, schedule, 4, writes=lambda t, e: True, check_every=16)
    out = machine.start()
    assert out == [Agree(False)]
    assert machine.agreed(False) == [Agree(False)]
    assert machine.agreed(False) == [Finish(None, False)]


def test_slots_come_back_only_after_every_writer() -> None:
    plan = make_plan([4096] * 3, range(3), 1, 1 << 20)
    schedule = transfer_schedule(plan, 4096, 2, pack=False)
    machine = FanOut(1, schedule, 1, writes=lambda t, e: True, hashes=lambda f: True, check_every=100)
    assert machine.start() == [Post(0, 0)]
    jobs = machine.call_done()
    assert jobs == [Write(0, 0, schedule[0].extents), Hash(0, 0, schedule[0].extents)]
    assert machine.write_done(0) == []  # the hasher still reads the slot
    assert machine.write_done(0) == [Post(1, 0)]


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        FanOut(0, [], 0, writes=lambda t, e: True)


def test_writes_are_spread_over_the_writers() -> None:
    extents = tuple(Extent(i, 0, 100, i * 100, True) for i in range(9))
    schedule = [Transfer(0, 0, (1,), extents, True)]
    machine = FanOut(1, schedule, 1, writes=lambda t, e: True, writers=3)
    machine.start()
    writes = machine.call_done()
    assert [len(w.extents) for w in writes if isinstance(w, Write)] == [3, 3, 3]
    assert tuple(e for w in writes if isinstance(w, Write) for e in w.extents) == extents
