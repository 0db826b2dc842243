"""The fan-out's decisions for one rank, as a state machine without I/O. Pure code.

The driver (:class:`azcp_cluster.fanout.driver.FanOutDriver`) owns the threads and the MPI
calls; it tells :class:`FanOut` what happened (a read, a call or a write finished, a
transfer's bytes landed on this node, something failed, the ranks agreed) and carries out
the instructions it gets back (read a slot, post a transfer, write or hash extents, join
an agreement, drain, finish). Everything that decides the order, the backpressure and the
way a failure stops all ranks together lives here, tested in process without MPI.

Rules, for the rank's own transfers (those it sends or receives, in schedule order):

* ``depth`` slots; the rank's ``k``-th transfer uses slot ``k % depth``. A slot is given to
  its next transfer only when every reader of its last one (writers, the hasher) is done:
  memory stays at ``depth`` slots whatever the disk's pace.
* A root's slot is read before it is posted; with streaming, not before its bytes have
  landed on the node. A receiver's slot is ready as soon as it is free.
* Transfers are posted in schedule order, at most ``depth`` in flight, and complete in that
  order (the driver tests the oldest).
* Every rank joins the same agreements: one before posting its first transfer at or past
  each multiple of ``check_every`` (by global sequence number), and the remaining ones
  after its last post. There every rank says whether it failed; if any did, all drain
  what they posted and stop at the same point.
* After a failure (its own, a peer's, a signal) a rank reads and writes nothing more but
  still posts its transfers until the agreement: no other rank is left in a collective.
* Every transfer carries one more byte, ``intact``, set by its root: whether the slot holds
  the transfer's bytes (it was read, without error). A root that failed posts slots it never
  filled (zeros, or an earlier transfer's bytes); a receiver that has not yet heard of that
  failure learns it from the byte and writes nothing of the transfer, so a stopped run's
  journal never records bytes that were not the source's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from azcp_cluster.core.errors import AzcpError
from azcp_cluster.core.schedule import Extent, Transfer, involving, transfers_at

# Ranks compare error flags this often (in transfers): rare enough to cost nothing, often
# enough that a failure stops the stage within a few transfers.
CHECK_EVERY = 16
# The rank's transfers are made (from the schedule's columns) this many at a time, as their
# turn comes: a million transfers are never all held at once.
MAKE_AHEAD = 64


@dataclass(frozen=True)
class Read:
    """Fill ``slot`` with transfer ``seq``'s extents (this rank is its root)."""

    seq: int
    slot: int


@dataclass(frozen=True)
class Post:
    """Start transfer ``seq``'s MPI calls on ``slot``; ``intact``: the root's slot holds the
    transfer's bytes (sent with them, see the module; a receiver's is always True)."""

    seq: int
    slot: int
    intact: bool = True


@dataclass(frozen=True)
class Write:
    """Write ``extents`` of transfer ``seq`` from ``slot`` to this node's files (one writer job)."""

    seq: int
    slot: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class Hash:
    """Add ``extents`` of transfer ``seq`` in ``slot`` to their files' MD5 (one hasher, in schedule order)."""

    seq: int
    slot: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class Agree:
    """Join the next agreement, saying whether this rank failed; answer with :meth:`FanOut.agreed`."""

    failed: bool


@dataclass(frozen=True)
class Drain:
    """Complete every call posted, without touching the slots again (the ranks are stopping)."""


@dataclass(frozen=True)
class Finish:
    """The fan-out is over on this rank: raise ``error`` if set, else PeerFailed if ``peer``."""

    error: AzcpError | None
    peer: bool


Instruction = Read | Post | Write | Hash | Agree | Drain | Finish


class _State(Enum):
    WAITING = "waiting"  # its slot still holds an earlier transfer
    LANDING = "landing"  # root: slot free, its bytes not yet on the node
    READING = "reading"
    READY = "ready"
    POSTED = "posted"
    USING = "using"  # complete; writers or the hasher still read the slot
    DONE = "done"


@dataclass
class _Item:
    index: int  # among this rank's transfers
    transfer: Transfer
    slot: int
    state: _State = _State.WAITING
    users: int = 0
    filled: bool = False  # root: its slot was read, without error


@dataclass
class FanOut:
    """One rank's fan-out (see the module). Feed it events; carry out what they return."""

    rank: int
    schedule: Sequence[Transfer]
    depth: int
    # Whether this rank writes an extent it receives or sends (not if its node has the file).
    writes: Callable[[Transfer, Extent], bool]
    # Whether this rank hashes a file's extents in flight (--verify stream), and with how
    # many writer jobs one transfer's writes are spread.
    hashes: Callable[[int], bool] = lambda file: False
    writers: int = 1
    # Streaming: whether a transfer this rank roots must wait for its bytes to land.
    waits_landing: Callable[[int], bool] = lambda seq: False
    check_every: int = CHECK_EVERY
    error: AzcpError | None = None
    peer: bool = False  # some other rank failed (seen before an agreement said so)
    # The rank's transfers, by sequence number (schedule.involving); an item for each is
    # made when its turn comes and dropped once done (see _item).
    mine: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    live: dict[int, _Item] = field(default_factory=dict)  # index among mine -> item
    by_seq: dict[int, _Item] = field(default_factory=dict)  # the live items by sequence number

    def __post_init__(self) -> None:
        if self.depth < 1 or self.writers < 1 or self.check_every < 1:
            raise ValueError("depth, writers and check_every must be at least 1")
        self.mine = involving(self.schedule, self.rank)
        self._made = 0  # items made so far (indices below it are live or done)
        self._landed: set[int] = set()
        self._next_post = 0  # index into items
        self._retired = 0  # items whose calls completed
        self._next_check = self.check_every  # the next agreement's global boundary
        self._checks_left = max(0, (len(self.schedule) - 1) // self.check_every)
        self._agreeing = False
        self._stopping = False  # agreed to stop: drain, then finish
        self._finished = False
        self._busy = 0  # items being read, or whose slot writers or the hasher still read
        self._done = 0  # items finished with

    # -- events -----------------------------------------------------------------------------

    def start(self) -> list[Instruction]:
        """The first instructions: prepare the first ``depth`` slots."""
        out: list[Instruction] = []
        for index in range(min(self.depth, len(self.mine))):
            self._prepare(self._item(index), out)
        self._advance(out)
        return out

    def landed(self, seq: int) -> list[Instruction]:
        """Transfer ``seq``'s bytes are on this node (streaming; this rank is its root)."""
        self._landed.add(seq)
        out: list[Instruction] = []
        item = self.by_seq.get(seq)
        if item is not None and item.state is _State.LANDING:
            self._read(item, out)
        self._advance(out)
        return out

    def read_done(self, seq: int, error: AzcpError | None = None) -> list[Instruction]:
        """The read of transfer ``seq`` into its slot finished (or failed)."""
        if error is not None:
            self._fail(error)
        item = self.by_seq[seq]
        assert item.state is _State.READING, f"read_done for {seq} in state {item.state}"
        item.filled = error is None
        self._set(item, _State.READY)
        out: list[Instruction] = []
        self._advance(out)
        return out

    def call_done(self, intact: bool = True) -> list[Instruction]:
        """The oldest posted transfer's MPI calls completed; ``intact``: the byte its root sent
        with it (a receiver's; False: the root had failed, nothing of it is written)."""
        item = self._item(self._retired)
        assert item.state is _State.POSTED, f"call_done for {item.transfer.seq} in state {item.state}"
        self._retired += 1
        out: list[Instruction] = []
        if not intact and item.transfer.root != self.rank and not self.failing:
            self._peer_failed()
        if not self._stopping:
            self._use(item, out)
        else:
            self._set(item, _State.DONE)
        self._advance(out)
        return out

    def write_done(self, seq: int, error: AzcpError | None = None) -> list[Instruction]:
        """A writer or the hasher finished with transfer ``seq``'s slot (or failed)."""
        if error is not None:
            self._fail(error)
        item = self.by_seq[seq]
        assert item.state is _State.USING and item.users > 0, f"write_done for {seq} in state {item.state}"
        item.users -= 1
        out: list[Instruction] = []
        if item.users == 0:
            self._release(item, out)
        self._advance(out)
        return out

    def failed(self, error: AzcpError | None) -> list[Instruction]:
        """This rank failed (``error``), or learnt that another one did (``None``)."""
        if error is None:
            self._peer_failed()
        else:
            self._fail(error)
            self._release_landing()
        out: list[Instruction] = []
        self._advance(out)
        return out

    def agreed(self, any_failed: bool) -> list[Instruction]:
        """The agreement asked for by :class:`Agree` ended; ``any_failed``: some rank failed."""
        assert self._agreeing
        self._agreeing = False
        self._checks_left -= 1
        self._next_check += self.check_every
        out: list[Instruction] = []
        if any_failed:
            self._stopping = True
            for index in range(self._retired, self._next_post):
                self._set(self._item(index), _State.DONE)  # drained by the driver
            self._retired = self._next_post
            out.append(Drain())
        self._advance(out)
        return out

    # -- queries ----------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether :class:`Finish` was given."""
        return self._finished

    @property
    def in_flight(self) -> int:
        """Transfers posted and not yet complete."""
        return self._next_post - self._retired

    @property
    def failing(self) -> bool:
        """Whether this rank has failed or knows of a failure (it reads and writes nothing more)."""
        return self.error is not None or self.peer

    # -- internals --------------------------------------------------------------------------

    def _item(self, index: int) -> _Item:
        """The rank's ``index``-th transfer's item: made (with the next few) on first use."""
        item = self.live.get(index)
        if item is not None:
            return item
        assert index >= self._made, f"item {index} asked for again after it was done"
        stop = min(len(self.mine), max(index + 1, self._made + MAKE_AHEAD))
        for k, transfer in enumerate(transfers_at(self.schedule, self.mine[self._made : stop]), start=self._made):
            made = self.live[k] = _Item(k, transfer, k % self.depth)
            self.by_seq[transfer.seq] = made
        self._made = stop
        return self.live[index]

    def _set(self, item: _Item, state: _State) -> None:
        """Move ``item`` to ``state``, keeping the busy and done counts; a done item is dropped."""
        busy = (_State.READING, _State.USING)
        self._busy += (state in busy) - (item.state in busy)
        self._done += (state is _State.DONE) - (item.state is _State.DONE)
        item.state = state
        if state is _State.DONE:
            self.live.pop(item.index, None)
            self.by_seq.pop(item.transfer.seq, None)

    def _fail(self, error: AzcpError) -> None:
        if self.error is None:
            self.error = error

    def _peer_failed(self) -> None:
        self.peer = True
        self._release_landing()

    def _release_landing(self) -> None:
        for item in list(self.live.values()):
            if item.state is _State.LANDING:  # nothing will be read: its turn must still come
                self._set(item, _State.READY)

    def _prepare(self, item: _Item, out: list[Instruction]) -> None:
        """The slot is free for ``item``: read it (root), or wait for its bytes, or it is ready."""
        if item.transfer.root != self.rank or self.failing or self._stopping:
            self._set(item, _State.READY)
        elif self.waits_landing(item.transfer.seq) and item.transfer.seq not in self._landed:
            self._set(item, _State.LANDING)
        else:
            self._read(item, out)

    def _read(self, item: _Item, out: list[Instruction]) -> None:
        if self.failing:
            self._set(item, _State.READY)
            return
        self._set(item, _State.READING)
        out.append(Read(item.transfer.seq, item.slot))

    def _use(self, item: _Item, out: list[Instruction]) -> None:
        """A completed transfer: hand its slot to the writers and the hasher, or release it."""
        transfer = item.transfer
        jobs: list[Instruction] = []
        if not self.failing:
            mine = tuple(e for e in transfer.extents if self.writes(transfer, e))
            for group in _spread(mine, self.writers):
                jobs.append(Write(transfer.seq, item.slot, group))
            hashed = tuple(e for e in transfer.extents if self.hashes(e.file))
            if hashed:
                jobs.append(Hash(transfer.seq, item.slot, hashed))
        self._set(item, _State.USING)
        item.users = len(jobs)
        out.extend(jobs)
        if not jobs:
            self._release(item, out)

    def _release(self, item: _Item, out: list[Instruction]) -> None:
        self._set(item, _State.DONE)
        following = item.index + self.depth
        if following < len(self.mine) and not self._stopping:
            self._prepare(self._item(following), out)

    def _advance(self, out: list[Instruction]) -> None:
        """Post whatever may be posted now; ask for agreements; finish when all is done."""
        if self._finished or self._agreeing:
            return
        while True:
            if self._stopping:
                break
            at_end = self._next_post >= len(self.mine)
            due = at_end or int(self.mine[self._next_post]) >= self._next_check
            if self._checks_left > 0 and due:
                self._agreeing = True
                out.append(Agree(failed=self.failing))
                return
            if at_end or self.in_flight >= self.depth:
                break
            item = self._item(self._next_post)
            if item.state is not _State.READY:
                break
            self._set(item, _State.POSTED)
            self._next_post += 1
            out.append(Post(item.transfer.seq, item.slot, item.transfer.root != self.rank or item.filled))
        if self._stopping:
            # Stopping: once nothing is in flight and no thread still uses a slot.
            over = self.in_flight == 0 and self._busy == 0
        else:
            over = self._checks_left == 0 and self._done == len(self.mine)
        if over:
            self._finished = True
            # Stopped by an agreement without an error of its own: another rank failed.
            out.append(Finish(self.error, (self.peer or self._stopping) and self.error is None))


def _spread(extents: tuple[Extent, ...], jobs: int) -> list[tuple[Extent, ...]]:
    """Split ``extents`` into at most ``jobs`` groups of about equal bytes, keeping their order."""
    if not extents:
        return []
    if jobs == 1 or len(extents) == 1:
        return [extents]
    total = sum(e.length for e in extents)
    share = total / jobs
    groups: list[tuple[Extent, ...]] = []
    start = 0
    acc = 0
    for i, extent in enumerate(extents):
        acc += extent.length
        if acc >= share * (len(groups) + 1) and len(groups) < jobs - 1 and i + 1 < len(extents):
            groups.append(extents[start : i + 1])
            start = i + 1
    groups.append(extents[start:])
    return groups
