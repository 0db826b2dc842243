"""The download workers' supervisor (core/supervisor.py), in process: each rule on its own, then
every event in every state against a model of the rules, exhaustively over short runs of two
workers and by property tests over longer runs of up to four."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.errors import AzcpError, DownloadError, InternalError
from azcp_cluster.core.supervisor import (
    STOP_GRACE_SECONDS,
    Done,
    Drop,
    Ended,
    Event,
    Instruction,
    Kill,
    PeerFailure,
    Refresh,
    Said,
    SendToken,
    Stopped,
    Supervisor,
    Tell,
    Tick,
    Token,
)

SILENCE = 5.0
GRACE = 8.0
FIRST = ("t", 100.0)


def machine(workers: int = 2, token: tuple[str, float] | None = FIRST, started: float = 0.0) -> Supervisor:
    return Supervisor([1000 + i for i in range(workers)], [started] * workers, SILENCE, token=token, grace=GRACE)


def failed(worker: int) -> DownloadError:
    return DownloadError(f"worker {worker} gave up")


# -- each rule on its own ---------------------------------------------------------------------


def test_no_worker_is_done_at_once_and_the_grace_is_the_documented_one() -> None:
    assert machine(0).start() == [Done(None, False)]
    assert machine(2).start() == []
    assert Supervisor([1], [0.0], 1.0).grace == STOP_GRACE_SECONDS == 10.0


def test_done_only_once_every_worker_said_its_last_and_only_at_a_tick() -> None:
    sup = machine(2)
    assert sup.feed(Said(0, "done", 1.0)) == [Drop(0)]
    assert sup.feed(Tick(1.0)) == [Refresh()]  # worker 1 still runs
    assert sup.feed(Said(1, "done", 2.0)) == [Drop(1)]
    assert not sup.finished
    assert sup.feed(Tick(2.0)) == [Done(None, False)]
    assert sup.finished
    assert sup.feed(Tick(3.0)) == [] and sup.feed(PeerFailure(3.0)) == []  # given once; nothing after it


def test_bytes_landed_and_alive_keep_a_worker_live_and_reset_its_silence() -> None:
    sup = machine(1)
    for at, kind in ((4.0, "alive"), (8.0, "bytes"), (12.0, "landed")):
        assert sup.feed(Said(0, kind, at)) == []
        assert sup.feed(Tick(at + SILENCE)) == [Refresh()]  # silent exactly the limit: not past it


def test_a_silent_worker_past_the_limit_is_named_killed_and_stops_the_others() -> None:
    sup = machine(3)
    sup.feed(Said(0, "alive", 2.0))
    sup.feed(Said(2, "alive", 2.0))
    out = sup.feed(Tick(5.5))  # worker 1 said nothing since it started, at 0
    assert out == [Kill(1, wait=False), Tell((0, 1, 2))]
    assert sup.stopping and sup.stop_by == 5.5 + GRACE
    # Its socket closes once killed: its end keeps the reason it was killed for.
    assert sup.feed(Ended(1, -9, 5.6)) == [Drop(1)]
    sup.feed(Said(0, "stopped", 6.0))
    sup.feed(Said(2, "stopped", 6.0))
    (done,) = sup.feed(Tick(6.0))
    assert isinstance(done, Done) and isinstance(done.error, DownloadError)
    assert str(done.error) == (
        "download worker 1 (pid 1001) said nothing for 6 s (frozen, or stuck starting); stopped it"
    )


def test_only_the_first_silent_worker_is_killed_and_silence_is_not_judged_while_stopping() -> None:
    sup = machine(2)
    assert sup.feed(Tick(6.0)) == [Kill(0, wait=False), Tell((0, 1))]
    assert sup.feed(Tick(7.0)) == []  # worker 1 is silent too: the stop is already under way


def test_a_stop_tells_each_live_worker_once_and_kills_them_after_the_grace() -> None:
    sup, error = machine(3), failed(1)
    assert sup.feed(Said(1, "error", 1.0, error)) == [Drop(1)]
    assert sup.feed(Tick(1.0)) == [Tell((0, 2))]
    assert sup.feed(Said(0, "alive", 2.0)) == []
    assert sup.feed(Tick(2.0)) == []  # told once: a worker that does not read must not fill its socket
    assert sup.feed(Tick(1.0 + GRACE - 0.01)) == []
    out = sup.feed(Tick(1.0 + GRACE))
    assert out == [Kill(0, wait=True), Drop(0), Kill(2, wait=True), Drop(2), Done(error, False)]


def test_the_grace_runs_from_the_first_failure_not_the_latest() -> None:
    sup = machine(3)
    sup.feed(PeerFailure(1.0))
    sup.feed(Said(0, "error", 5.0, failed(0)))
    assert sup.stop_by == 1.0 + GRACE
    assert sup.feed(Tick(1.0 + GRACE))[:2] == [Tell((1, 2)), Kill(1, wait=True)]


def test_a_peers_failure_stops_every_worker_and_the_run_ends_stopped() -> None:
    sup = machine(2)
    assert sup.feed(PeerFailure(3.0)) == []
    assert sup.feed(Tick(3.0)) == [Tell((0, 1))]  # no token refresh while stopping
    sup.feed(Said(0, "stopped", 4.0))
    sup.feed(Ended(1, 0, 4.0))  # closed without its last word while stopping: a stop, not its failure
    assert sup.feed(Tick(4.0)) == [Done(None, True)]


def test_a_peers_failure_after_every_worker_finished_changes_nothing() -> None:
    sup = machine(1)
    sup.feed(Said(0, "done", 1.0))
    sup.feed(PeerFailure(1.0))
    assert sup.feed(Tick(1.0)) == [Done(None, False)]


def test_a_worker_that_dies_unasked_is_the_runs_error_naming_it() -> None:
    sup = machine(2)
    assert sup.feed(Ended(0, -9, 1.0)) == [Drop(0)]
    assert sup.feed(Tick(1.0)) == [Tell((1,))]
    sup.feed(Said(1, "stopped", 2.0))
    (done,) = sup.feed(Tick(2.0))
    assert isinstance(done, Done) and not done.stopped
    assert str(done.error) == "download worker 0 (pid 1000) ended without finishing (exit code -9)"


def test_the_runs_error_is_the_lowest_workers_own_one_never_a_stop() -> None:
    sup, error = machine(4), failed(2)
    sup.feed(Said(3, "error", 1.0, failed(3)))
    sup.feed(Said(0, "stopped", 1.0))
    sup.feed(Said(2, "error", 1.5, error))
    sup.feed(Said(1, "done", 1.5))
    assert sup.feed(Tick(2.0)) == [Done(error, False)]


def test_a_message_the_rank_does_not_know_is_a_workers_last_and_an_internal_error() -> None:
    sup = machine(1)
    assert sup.feed(Said(0, "hello", 1.0)) == [Drop(0)]
    (done,) = sup.feed(Tick(1.0))
    assert isinstance(done, Done) and isinstance(done.error, InternalError)
    assert str(done.error) == "download worker 0 sent 'hello'"


def test_a_killed_or_stopped_workers_error_says_so() -> None:
    sup = machine(2)
    sup.feed(PeerFailure(0.0))
    sup.feed(Said(1, "stopped", 0.5))
    sup.feed(Tick(GRACE))
    assert [str(s.error) for s in sup.seats] == ["download worker 0 killed", "download worker 1 stopped"]
    assert all(isinstance(s.error, Stopped) for s in sup.seats)
    sup = machine(1)
    sup.feed(PeerFailure(0.0))
    sup.feed(Ended(0, 143, 0.5))
    assert str(sup.seats[0].error) == "download worker 0 ended (exit code 143)"


def test_a_new_token_goes_to_every_live_worker_before_the_old_one_expires() -> None:
    sup = machine(3)
    sup.feed(Said(1, "done", 0.5))
    assert sup.feed(Tick(1.0)) == [Refresh()]
    assert sup.feed(Token(FIRST)) == []  # the cache still has the one they were given
    fresh = ("u", 200.0)
    assert sup.feed(Token(fresh)) == [SendToken((0, 2), fresh)]
    assert sup.feed(Token(fresh)) == []  # sent once
    sup.feed(PeerFailure(2.0))
    assert sup.feed(Tick(2.0)) == [Tell((0, 2))]  # no Refresh while stopping
    assert sup.feed(Token(("v", 300.0))) == []  # nor a token


def test_without_tokens_nothing_is_refreshed() -> None:
    sup = machine(1, token=None)
    assert sup.feed(Tick(1.0)) == []


def test_messages_from_a_worker_no_longer_listened_to_are_ignored() -> None:
    sup = machine(2)
    sup.feed(Said(0, "done", 1.0))
    assert sup.feed(Said(0, "error", 1.0, failed(0))) == [] and sup.feed(Ended(0, 1, 1.0)) == []
    assert not sup.stopping


def test_a_workers_silence_counts_from_its_start() -> None:
    sup = Supervisor([7, 8], [0.0, 3.0], SILENCE, token=None, grace=GRACE)
    assert sup.feed(Tick(5.5)) == [Kill(0, wait=False), Tell((0, 1))]  # not worker 1: started at 3


# -- every event in every state, against a model of the rules ---------------------------------


@dataclass
class Model:
    """The rules of core/supervisor.py's docstring, restated: what each event must give."""

    workers: int
    token: tuple[str, float] | None = FIRST
    live: set[int] = field(default_factory=set)
    heard: dict[int, float] = field(default_factory=dict)
    told: set[int] = field(default_factory=set)
    errors: dict[int, AzcpError] = field(default_factory=dict)
    stop_by: float | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self.live = set(range(self.workers))
        self.heard = dict.fromkeys(self.live, 0.0)

    def start(self) -> list[Instruction]:
        return self._done_if_over([])

    def expect(self, event: Event) -> list[Instruction]:
        if self.done:
            return []
        if isinstance(event, PeerFailure):
            self._stop(event.at)
            return []
        if isinstance(event, Token):
            if self.stop_by is not None or event.value == self.token:
                return []
            self.token = event.value
            return [SendToken(tuple(sorted(self.live)), event.value)] if self.live else []
        if isinstance(event, Tick):
            return self._tick(event.at)
        if event.worker not in self.live:
            return []
        self.heard[event.worker] = event.at
        if isinstance(event, Said) and event.kind in ("alive", "bytes", "landed"):
            return []
        self.live.discard(event.worker)
        error = self._error(event)
        if isinstance(event, Said) and error is not None:
            self.errors[event.worker] = error  # its own last word is its reason, even once killed
        elif error is not None:
            self.errors.setdefault(event.worker, error)  # a close keeps the reason it was killed for
        if event.worker in self.errors:
            self._stop(event.at)
        return [Drop(event.worker)]

    def _error(self, event: Said | Ended) -> AzcpError | None:
        if isinstance(event, Ended):
            return Stopped("ended") if self.stop_by is not None else DownloadError("ended without finishing")
        return {"done": None, "error": event.error, "stopped": Stopped("stopped")}.get(event.kind, InternalError("?"))

    def _stop(self, at: float) -> None:
        if self.stop_by is None:
            self.stop_by = at + GRACE

    def _tick(self, at: float) -> list[Instruction]:
        out: list[Instruction] = []
        silent = [w for w in sorted(self.live) if at - self.heard[w] > SILENCE]
        if self.live and self.stop_by is None and silent:
            self.errors[silent[0]] = DownloadError("said nothing")
            out.append(Kill(silent[0], wait=False))
            self._stop(at)
        if self.live and self.stop_by is not None:
            untold = tuple(sorted(self.live - self.told))
            self.told |= self.live
            out += [Tell(untold)] if untold else []
            if at >= self.stop_by:
                for w in sorted(self.live):
                    self.errors.setdefault(w, Stopped("killed"))
                    out += [Kill(w, wait=True), Drop(w)]
                self.live.clear()
        elif self.live and self.token is not None:
            out.append(Refresh())
        return self._done_if_over(out)

    def _done_if_over(self, out: list[Instruction]) -> list[Instruction]:
        if self.live or self.done:
            return out
        self.done = True
        own = [self.errors[w] for w in sorted(self.errors) if not isinstance(self.errors[w], Stopped)]
        return [*out, Done(own[0] if own else None, bool(self.errors) and not own)]


def _same(got: Sequence[Instruction], want: Sequence[Instruction]) -> bool:
    """Equal, errors compared by their class (their words are tested above)."""
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if isinstance(g, Done) and isinstance(w, Done):
            if type(g.error) is not type(w.error) or g.stopped != w.stopped:
                return False
        elif g != w:
            return False
    return True


# The events tried in every state: each kind of message from each worker, its socket's
# close, a short and a long tick (past the silence limit; two are past the grace), a peer's
# failure, the same token and a new one. ("bytes" and "landed" are "alive" to the machine.)
KINDS = ("alive", "done", "error", "stopped", "nonsense")
Word = tuple[str, object]


def _alphabet(workers: int) -> list[Word]:
    words: list[Word] = [("said", (w, kind)) for w in range(workers) for kind in KINDS]
    words += [("ended", w) for w in range(workers)]
    return [*words, ("tick", 1.0), ("tick", 6.0), ("peer", None), ("token", FIRST), ("token", ("new", 9.0))]


def _event(word: Word, now: float) -> tuple[Event, float]:
    """The event ``word`` stands for at ``now``, and the time after it (a tick moves it on)."""
    name, arg = word
    if name == "tick":
        assert isinstance(arg, float)
        return Tick(now + arg), now + arg
    if name == "said":
        assert isinstance(arg, tuple)
        worker, kind = arg
        return Said(worker, kind, now, failed(worker) if kind == "error" else None), now
    if name == "ended":
        assert isinstance(arg, int)
        return Ended(arg, -9, now), now
    if name == "peer":
        return PeerFailure(now), now
    return Token(arg), now  # type: ignore[arg-type]


def _step(sup: Supervisor, model: Model, event: Event) -> list[Instruction]:
    """Feed ``event`` to both; the machine's instructions, checked against the model's and
    against what holds whatever the rules' details."""
    live, told = set(sup.live()), {i for i, seat in enumerate(sup.seats) if seat.told}
    was_stopping, was_finished = sup.stopping, sup.finished
    got, want = sup.feed(event), model.expect(event)
    assert _same(got, want), (event, got, want)
    assert sup.live() == tuple(sorted(model.live)) and sup.stopping == (model.stop_by is not None)
    for i, step in enumerate(got):
        if isinstance(step, Done):
            assert i == len(got) - 1 and not sup.live() and not was_finished  # once, the last word
        if isinstance(step, Kill) and step.wait:
            assert got[i + 1] == Drop(step.worker)  # killed and waited for: no longer listened to
        named = set(step.workers) if isinstance(step, Tell | SendToken) else set()
        named |= {step.worker} if isinstance(step, Kill | Drop) else set()
        assert named <= live  # nothing is done to a worker already gone
        if isinstance(step, Tell):
            assert not set(step.workers) & told  # each told once
        if isinstance(step, SendToken | Refresh):
            assert not was_stopping and not sup.stopping
    return got


def _key(sup: Supervisor, now: float) -> tuple[object, ...]:
    """What the machine's next answers depend on, with times relative to ``now`` (ages past
    the silence limit, and a grace that is over, all alike): equal keys, equal futures."""
    seats = tuple((s.live, s.told, type(s.error).__name__, min(now - s.heard, SILENCE + 1)) for s in sup.seats)
    stop = None if sup.stop_by is None else max(0.0, sup.stop_by - now)
    return seats, stop, sup.token, sup.finished


def _clone(sup: Supervisor, model: Model) -> tuple[Supervisor, Model]:
    """Copies of both to go on from (a deep copy, only faster: the explorations make many)."""
    sup_copy, model_copy = copy.copy(sup), copy.copy(model)
    sup_copy.seats = [replace(seat) for seat in sup.seats]
    model_copy.live, model_copy.told = set(model.live), set(model.told)
    model_copy.heard, model_copy.errors = dict(model.heard), dict(model.errors)
    return sup_copy, model_copy


def _explore(workers: int, token: tuple[str, float] | None) -> int:
    """Every event in every state the machine can reach (breadth first, equal states once); how many states."""
    sup, model = machine(workers, token), Model(workers, token)
    assert _same(sup.start(), model.start())
    seen = {_key(sup, 0.0)}
    frontier = [(sup, model, 0.0)]
    while frontier:
        sup, model, now = frontier.pop()
        for word in _alphabet(workers):
            after_sup, after_model = _clone(sup, model)
            event, later = _event(word, now)
            _step(after_sup, after_model, event)
            key = _key(after_sup, later)
            if key not in seen:
                seen.add(key)
                frontier.append((after_sup, after_model, later))
    return len(seen)


@pytest.mark.parametrize(("workers", "token"), [(1, None), (1, FIRST), (2, FIRST)])
def test_every_event_in_every_reachable_state_follows_the_rules(workers: int, token: tuple[str, float] | None) -> None:
    states = _explore(workers, token)
    assert states > 40 * workers  # not vacuous: silences, stops, graces, errors and tokens were all reached


@settings(max_examples=300, deadline=None)
@given(workers=st.integers(0, 4), data=st.data())
def test_long_runs_of_up_to_four_workers_follow_the_rules(workers: int, data: st.DataObject) -> None:
    alphabet = _alphabet(workers)
    words = data.draw(st.lists(st.sampled_from(alphabet), max_size=40))
    sup, model = machine(workers), Model(workers)
    trace = sup.start()
    assert _same(trace, model.start())
    now = 0.0
    for word in [*words, ("tick", 1.0)]:
        event, now = _event(word, now)
        trace += _step(sup, model, event)
    dropped = [step.worker for step in trace if isinstance(step, Drop)]
    assert len(dropped) == len(set(dropped))  # each worker dropped once
    assert sup.finished == (len(dropped) == workers)  # done at the first tick once every worker is gone
    assert len([s for s in trace if isinstance(s, Kill) and not s.wait]) <= 1  # one silent one killed at most


def test_a_run_that_ticks_long_enough_always_ends() -> None:
    # Whatever the workers do (here: nothing), the silence limit and then the grace end the run.
    sup = machine(3)
    out: list[Instruction] = []
    for at in range(1, 40):
        out += sup.feed(Tick(float(at)))
    assert sup.finished and isinstance(out[-1], Done) and isinstance(out[-1].error, DownloadError)
