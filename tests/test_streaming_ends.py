"""How a leader's part of the streaming stage ends (fanout/streaming.lead), in process.

The fan-out and the download are fakes; what is checked is lead's own rules: the download
runs on a thread beside the fan-out and its end time is recorded; a fan-out that fails stops
the download; a peer's failure gives way to this rank's own download error; a download that
fails once the fan-out is done is raised after it; no thread, or nothing to download, is no
download at all.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from azcp_cluster.core.errors import AzcpError
from azcp_cluster.fanout.streaming import Streamed, lead
from azcp_cluster.run.cluster import PeerFailed

WAIT = 10.0  # seconds a fake waits for the other side at most (a hang fails the test, not the run)


class Feed:
    """The landing feed as lead uses it: told of the download thread's failure."""

    def __init__(self) -> None:
        self.failed: list[AzcpError] = []
        self.told = threading.Event()

    def local_failed(self, error: AzcpError) -> None:
        self.failed.append(error)
        self.told.set()


class Fanout:
    """A fan-out that returns ``stats``, or raises ``error`` (after the download told the feed, if ``after_feed``)."""

    def __init__(self, stats: object = "fanned", error: BaseException | None = None, after_feed: bool = False) -> None:
        self.stats, self.error, self.after_feed = stats, error, after_feed
        self.digests = {0: "md5"}
        self.feed: Feed | None = None

    def run(self, schedule: Sequence[object], hooks: object, **kw: Any) -> object:
        self.feed = kw["feed"]
        if self.after_feed:
            assert self.feed is not None and self.feed.told.wait(WAIT)
        if self.error is not None:
            raise self.error
        return self.stats


class Fetcher:
    """A download that returns ``stats``, raises ``error``, or waits for ``until`` (the stop) and is stopped."""

    def __init__(
        self, stats: object = "downloaded", error: BaseException | None = None, until: threading.Event | None = None
    ) -> None:
        self.stats, self.error, self.until = stats, error, until

    def run(self, blocks: Sequence[object]) -> object:
        if self.until is not None:
            assert self.until.wait(WAIT), "the download was never stopped"
            raise PeerFailed()
        if self.error is not None:
            raise self.error
        return self.stats


def _lead(fanout: Fanout, fetcher: Fetcher | None, stop: threading.Event, blocks: Sequence[object] = ("b",)) -> Any:
    feed = Feed()
    clock = iter([7.5, 99.0])
    result = lead(
        fanout,  # type: ignore[arg-type]
        [],
        feed,  # type: ignore[arg-type]
        fetcher,  # type: ignore[arg-type]
        blocks,  # type: ignore[arg-type]
        lambda: next(clock),
        3,
        stop,
        None,  # type: ignore[arg-type]
    )
    return result, feed


def test_the_download_runs_beside_the_fan_out_and_its_end_is_recorded() -> None:
    stop = threading.Event()
    result, feed = _lead(Fanout(), Fetcher(), stop)
    assert result == Streamed(7.5, "downloaded", "fanned", {0: "md5"})  # type: ignore[arg-type]
    assert not stop.is_set() and not feed.failed


def test_nothing_to_download_is_no_download() -> None:
    result, _ = _lead(Fanout(), Fetcher(), threading.Event(), blocks=())
    assert result == Streamed(0.0, None, "fanned", {0: "md5"})  # type: ignore[arg-type]
    result, _ = _lead(Fanout(), None, threading.Event())
    assert result == Streamed(0.0, None, "fanned", {0: "md5"})  # type: ignore[arg-type]


def test_a_fan_out_that_fails_stops_the_download_and_is_the_error() -> None:
    stop = threading.Event()
    with pytest.raises(RuntimeError, match="fan-out bug"):
        _lead(Fanout(error=RuntimeError("fan-out bug")), Fetcher(until=stop), stop)
    assert stop.is_set()


def test_a_peers_failure_gives_way_to_this_ranks_own_download_error() -> None:
    own = AzcpError("disk full")
    with pytest.raises(AzcpError, match="disk full") as caught:
        _lead(Fanout(error=PeerFailed(), after_feed=True), Fetcher(error=own), threading.Event())
    assert caught.value is own and caught.value.__suppress_context__


def test_a_peers_failure_stays_when_the_download_was_only_stopped() -> None:
    stop = threading.Event()
    with pytest.raises(PeerFailed):
        _lead(Fanout(error=PeerFailed()), Fetcher(until=stop), stop)
    assert stop.is_set()


def test_a_download_that_fails_is_told_to_the_feed_and_raised_after_the_fan_out() -> None:
    own = AzcpError("gone")
    fanout = Fanout(after_feed=True)
    with pytest.raises(AzcpError, match="gone"):
        _lead(fanout, Fetcher(error=own), threading.Event())
    assert fanout.feed is not None and fanout.feed.failed == [own]


def test_no_thread_for_the_download_fails_the_fan_out_through_the_feed(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    fanout = Fanout(after_feed=True)
    result, feed = _lead(fanout, Fetcher(), threading.Event())
    assert result.downloaded == 0.0 and result.download is None
    assert len(feed.failed) == 1 and "can't start new thread" in feed.failed[0].message
