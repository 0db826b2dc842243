"""The figures each stage hands the report: frozen, typed, one class per kind of stage.

A stage builds its figures from what every rank brought to its agreement (each rank's own
counters travel as :class:`RankDownload` / :class:`RankFanout`) and passes them to the
run's recorder; :meth:`azcp_cluster.run.report.Report.record` is the one place that turns
them into the report's fields. No stage imports the report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankDownload:
    """One rank's download counters, as its stage outcome carries them to every rank."""

    bytes: int = 0
    retries: int = 0
    causes: Mapping[str, int] = field(default_factory=dict)  # retry cause -> count
    refused: str | None = None  # a path where the filesystem refused O_DIRECT (the first seen)
    workers: tuple[int, ...] = ()  # bytes each download worker process fetched (none: the rank itself)


@dataclass(frozen=True)
class RankFanout:
    """One rank's fan-out counters (a leader's; the others bring zeros)."""

    fanned: int = 0  # bytes of the transfers done here (a failed stage reports those)
    refused: str | None = None  # a path where the filesystem refused O_DIRECT
    changed: tuple[int, ...] = ()  # local SOURCE files that changed while this rank read them
    source_bytes: int = 0  # bytes this rank read from a local SOURCE
    memory: int = 0  # streaming: bytes sent from the download's buffers instead of the disk
    downloaded: float = 0.0  # streaming: seconds from the stage's start to this rank's last byte landed
    download: RankDownload | None = None  # streaming: this rank's download, if it had one
    lane: int = 0  # the rail whose chain this rank is in (its place among its node's ranks)


@dataclass(frozen=True)
class Roles:
    """Who does what (setup)."""

    nodes: int
    writers: int
    download_ranks: int
    source_rank: int | None
    source_readers: tuple[int, ...]
    # Per rank, the fabric device it is bound to (its AZCP_RAIL_DEVICE, run/rails.py; "" none known).
    rail_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Listed:
    """What SOURCE holds (list)."""

    files: int
    bytes: int
    markers_skipped: int
    filtered_out: int
    seconds: float


@dataclass(frozen=True)
class Compared:
    """What each node has already (diff)."""

    list_seconds: float  # the slowest rank's list stage (the listers' helpers included)
    resumed_files: int
    resumed_bytes: int
    skipped_files: int
    skipped_bytes: int
    transfer_files: int
    peer_files: int
    seconds: float


@dataclass(frozen=True)
class Planned:
    """The plan: each rank's load, their spread, the shards."""

    loads: tuple[int, ...]
    spread: float
    shards: int


@dataclass(frozen=True)
class FanoutChosen:
    """The fan-out's transport as the leaders chose it (core/chain.FanoutChoice.as_dict)."""

    choice: Mapping[str, object]


@dataclass(frozen=True)
class Downloaded:
    """The download stage, or the download inside a streamed transfer (``streamed``)."""

    seconds: float  # the slowest rank's (streamed: to its last byte landed)
    ranks: tuple[RankDownload, ...]


@dataclass(frozen=True)
class FannedOut:
    """One round of the fan-out (``streamed``: the download ran inside it)."""

    seconds: float
    payload: int  # bytes of file data the round's transfers carry
    ranks: tuple[RankFanout, ...]
    failed: bool  # the round failed: the report counts what the busiest leader did
    streamed: bool = False
    local: bool = False  # a local SOURCE: the bytes each rank read from it are counted


@dataclass(frozen=True)
class Resent:
    """A second round, for local files that changed while they were read: the listing's new size."""

    bytes: int


@dataclass(frozen=True)
class Finished:
    """A stage after the fan-out that counts in its time (sync, rename)."""

    seconds: float


@dataclass(frozen=True)
class Verified:
    """The verify stage (``files``/``against_source`` None: it failed, only its time counts)."""

    seconds: float
    files: int | None = None
    against_source: int | None = None


@dataclass(frozen=True)
class Deleted:
    """What ``--delete`` removed (delete), over every node."""

    files: int  # files removed, counted in each copy that lost one
    distinct: int  # distinct paths removed (a path gone from two copies counts once)
    bytes: int
    copies: int  # copies (nodes' DESTs) that lost something
    paths: tuple[str, ...]  # the distinct paths removed, in order, up to mirror.REPORTED_PATHS
    kept: int  # files chosen at the walk but changed or gone since: left as they were


# One stage's entry in the report's timeline: {"stage": name, "start": [per rank], "end": [per rank]}.
TimelineEntry = dict[str, Any]

Figures = (
    Roles | Listed | Compared | Planned | FanoutChosen | Downloaded | FannedOut | Resent | Finished | Verified | Deleted
)
Recorder = Callable[[Figures], None]  # the run's report's record, handed to the stages
