"""The run's report: the stable text lines scripts parse, and the JSON document."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from typing import TYPE_CHECKING, Any, TextIO

from azcp_cluster.core.config import format_bytes
from azcp_cluster.core.errors import UsageError, printable
from azcp_cluster.run import figures as fig
from azcp_cluster.run.console import say
from azcp_cluster.run.figures import Figures, TimelineEntry

if TYPE_CHECKING:
    from azcp_cluster.run.console import Console

# The JSON document (what json.loads gives back: any JSON value under each key).
Json = dict[str, Any]
STAGES = ("list", "diff", "download", "bcast", "verify", "total")


def check_json_path(path: str | None) -> None:
    """Refuse a ``--json`` PATH that is an existing directory (exit 2), before any work.

    Whether it lies inside DEST is checked per rank once DEST is expanded
    (:func:`azcp_cluster.core.config.json_inside_dest`).
    """
    if path and os.path.isdir(path):
        raise UsageError(f"--json {path!r} is a directory; name a file to write the report to")
    if path and not _replaceable(path):
        raise UsageError(
            f"--json {path!r} exists and is not a regular file (a link, a device, a FIFO); name a file to write"
        )


def _replaceable(path: str) -> bool:
    """Whether the report may take ``path``'s place: nothing there, or a regular file.

    A link, a device node (``--json /dev/null`` as root) or a FIFO is never replaced.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return True  # the write will say what is wrong
    return stat.S_ISREG(st.st_mode)


@dataclass
class StageFigures:
    """Wall time of one stage (the slowest rank's) and the bytes it moved."""

    seconds: float = 0.0
    bytes: int = 0


@dataclass
class Report:
    """Everything the JSON report carries; also what the Python API returns."""

    ranks: int = 0
    nodes: int = 0  # distinct hosts
    writers: int = 0  # copies written: one leader rank per (host, DEST)
    download_ranks: int = 0  # ranks that fetched from Azure (0 for a local SOURCE)
    source_rank: int | None = None  # the rank that read a local SOURCE (the first, with --source-readers)
    source_readers: list[int] = field(default_factory=list)  # every rank that read it
    source_bytes_by_rank: list[int] = field(default_factory=list)  # bytes each rank read from it
    rail_devices: list[str] = field(default_factory=list)  # per rank, the fabric device it is bound to ("" none)
    # Per rail (a chain of the fan-out: lane i of every node), the bytes of file data its chain
    # carried; one entry with one rail.
    rail_bytes: list[int] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    skipped_files: int = 0
    skipped_bytes: int = 0
    markers_skipped: int = 0
    filtered_out: int = 0
    transfer_files: int = 0
    peer_files: int = 0
    # Files with blocks a stopped run left durably in some node's temporary file, and those
    # bytes, summed over the nodes' copies: kept, not moved again (journal.py).
    resumed_files: int = 0
    resumed_bytes: int = 0
    azure_files: int = 0  # files read from SOURCE (Azure, or the local path)
    downloaded_bytes: int = 0
    download_rate: float = 0.0  # bytes per second: downloaded_bytes over the download stage's time
    max_bandwidth: float | None = None  # --max-bandwidth in bytes per second (None: no cap)
    broadcast_bytes: int = 0
    broadcast_shards: int = 0
    # Streaming: bytes the leaders sent from their download's buffers instead of reading them
    # back from the disk (the rest of what they downloaded was read back).
    sent_from_memory_bytes: int = 0
    retries: int = 0
    retry_causes: dict[str, int] = field(default_factory=dict)
    retries_by_rank: list[int] = field(default_factory=list)  # index: rank
    # Per rank: the bytes each of its download worker processes fetched ([] if it had none:
    # its GETs ran in the rank itself).
    worker_bytes_by_rank: list[list[int]] = field(default_factory=list)
    exit_code: int = 0
    error: str | None = None
    dry_run: bool = False
    overlap: bool = False  # download and fan-out ran at once (their stage times overlap)
    # How the fan-out moved the bytes between the nodes (core/chain.FanoutChoice.as_dict:
    # method, piece, reason and, for --fanout auto, the probe's figures); {} without a fan-out.
    fanout: dict[str, object] = field(default_factory=dict)
    plan_loads: list[int] = field(default_factory=list)
    plan_spread: float = 0.0
    verified_files: int = 0
    # --delete: the files removed from the copies (each copy's count), their bytes, the
    # copies that lost any, the distinct paths (the first mirror.REPORTED_PATHS, in order),
    # and the files chosen but changed or gone since DEST was looked at (left as they were).
    deleted_files: int = 0
    deleted_bytes: int = 0
    deleted_copies: int = 0
    deleted_paths: list[str] = field(default_factory=list)
    deleted_kept: int = 0
    deleted_distinct_files: int = 0
    verified_against_source: int = 0  # of those, checked against the source's CRC-32 (core/crc.py)
    peak_rss_bytes: int = 0  # the largest peak resident memory of any rank, at the last agreement (Cluster.peak_rss)
    stages: dict[str, StageFigures] = field(default_factory=lambda: {s: StageFigures() for s in STAGES})
    # Where the time goes: per stage agreed (in the order run), each rank's start and end of
    # its own work, in seconds since that rank's run started ({"stage", "start": [per rank],
    # "end": [per rank]}; None where a rank had no part: the download inside a streaming
    # transfer, on a rank with nothing to fetch). The wait for the slowest rank follows each.
    timeline: list[TimelineEntry] = field(default_factory=list)
    timeline_origin: list[float] = field(default_factory=list)  # per rank: its run's start, Unix time

    def record(self, figures: Figures) -> None:
        """A stage's figures into the report's fields: the one place a stage's outcome is written.

        Called through the run's recorder when a stage's agreement is reached, also for a
        stage that failed (its figures so far: bytes, retries, time).
        """
        match figures:
            case fig.Roles():
                self.nodes, self.writers, self.download_ranks = figures.nodes, figures.writers, figures.download_ranks
                self.source_rank, self.source_readers = figures.source_rank, list(figures.source_readers)
                self.rail_devices = list(figures.rail_devices)
            case fig.Listed():
                self.files, self.bytes = figures.files, figures.bytes
                self.markers_skipped, self.filtered_out = figures.markers_skipped, figures.filtered_out
                self.stages["list"] = StageFigures(figures.seconds, 0)
            case fig.Compared():
                self._record_compared(figures)
            case fig.Planned():
                self.plan_loads, self.plan_spread = list(figures.loads), figures.spread
                self.broadcast_shards = figures.shards
            case fig.FanoutChosen():
                self.fanout = self.fanout or dict(figures.choice)
            case fig.Downloaded():
                self._record_download(figures)
            case fig.FannedOut():
                self._record_fanout(figures)
            case fig.Resent():
                self.bytes = figures.bytes
            case fig.Finished():
                self.stages["bcast"].seconds += figures.seconds
            case fig.Deleted():
                self.deleted_files, self.deleted_bytes, self.deleted_kept = figures.files, figures.bytes, figures.kept
                self.deleted_distinct_files = figures.distinct
                # Shown, not parsed back: a name's control characters escaped (one JSON string a line).
                self.deleted_copies, self.deleted_paths = figures.copies, [printable(p) for p in figures.paths]
            case fig.Verified():
                self.stages["verify"] = StageFigures(figures.seconds, self.bytes)
                if figures.files is not None:
                    self.verified_files = figures.files
                if figures.against_source is not None:
                    self.verified_against_source = figures.against_source

    def ended(self, seconds: float, timeline: list[TimelineEntry], origins: list[float], peak_rss: int) -> None:
        """The run's end, on every rank: its total time, the timeline every agreement gathered
        (and each rank's start, Unix time), the largest peak memory of any rank."""
        self.stages["total"].seconds = seconds
        self.timeline, self.timeline_origin = timeline, origins
        self.peak_rss_bytes = peak_rss

    def failed(self, exit_code: int, error: str) -> None:
        """The run failed: its exit code and one-line error."""
        self.exit_code, self.error = exit_code, error

    def _record_compared(self, figures: fig.Compared) -> None:
        self.resumed_files, self.resumed_bytes = figures.resumed_files, figures.resumed_bytes
        self.stages["list"].seconds = figures.list_seconds
        self.skipped_files, self.skipped_bytes = figures.skipped_files, figures.skipped_bytes
        self.transfer_files, self.peer_files = figures.transfer_files, figures.peer_files
        self.azure_files = figures.transfer_files - figures.peer_files
        self.stages["diff"] = StageFigures(figures.seconds, 0)

    def _record_download(self, figures: fig.Downloaded) -> None:
        """The download's bytes, retries and their causes, its time (the slowest rank's) and rate."""
        causes: Counter[str] = Counter()
        for rank in figures.ranks:
            causes.update(rank.causes)
        self.downloaded_bytes = sum(rank.bytes for rank in figures.ranks)
        self.retries = sum(rank.retries for rank in figures.ranks)
        self.retries_by_rank = [rank.retries for rank in figures.ranks]
        self.retry_causes = dict(causes)
        self.worker_bytes_by_rank = [list(rank.workers) for rank in figures.ranks]
        seconds = figures.seconds
        self.stages["download"] = StageFigures(seconds, self.downloaded_bytes)
        self.download_rate = self.downloaded_bytes / seconds if seconds > 0 else 0.0

    def _record_fanout(self, figures: fig.FannedOut) -> None:
        """A fan-out round: its time and bytes (a failed one: what the busiest leader did), the
        bytes sent from memory and those read from a local SOURCE; a second round adds to the first."""
        ranks = figures.ranks
        self.stages["bcast"].seconds += figures.seconds
        if figures.streamed:
            self.overlap = True  # the mode, reported also when the stage fails
            self.sent_from_memory_bytes += sum(rank.memory for rank in ranks)
        carried: dict[int, int] = {}
        for rank in ranks:  # every rank of a chain takes part in every transfer it carries
            carried[rank.lane] = max(carried.get(rank.lane, 0), rank.fanned)
        rails = [carried.get(lane, 0) for lane in range(max(carried, default=-1) + 1)]
        self.rail_bytes = [a + b for a, b in zip_longest(self.rail_bytes, rails, fillvalue=0)]
        if figures.failed:
            self.broadcast_bytes += sum(rails)
            return
        self.broadcast_bytes += figures.payload
        self.stages["bcast"].bytes += figures.payload
        if figures.local:
            read = [rank.source_bytes for rank in ranks]
            before = self.source_bytes_by_rank or [0] * len(read)
            self.source_bytes_by_rank = [a + b for a, b in zip(before, read, strict=True)]

    def to_json(self) -> Json:
        """The JSON document written by ``--json``."""
        return asdict(self)

    def write_json(self, path: str, **override: object) -> None:
        """Write the JSON report atomically: a temporary name in the same directory, fsync, rename.

        ``override`` replaces top-level fields in what is written (the report itself is left
        as it is). The temporary file is created anew (``O_EXCL``, never through a symlink
        someone put at its name) and removed again on any failure, so a failed write leaves
        nothing behind. Raises the ``OSError``.
        """
        write_json_document({**self.to_json(), **override}, path)


def write_synced(fd: int, data: bytes) -> None:
    """Write all of ``data`` at ``fd``'s position, then fsync (a small file of the tool's own: the
    JSON report, the manifest)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def write_json_document(doc: Json, path: str, durable: bool = True) -> None:
    """:meth:`Report.write_json` for a document already made; ``durable=False`` skips the fsync."""

    data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")
    tmp = f"{path}.tmp{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o644)
    try:
        try:
            if durable:
                write_synced(fd, data)
            else:
                os.write(fd, data)  # a small file: one write
        finally:
            os.close(fd)
        if not _replaceable(path):  # put there since the start: not ours to replace
            raise OSError(errno.EEXIST, "exists and is not a regular file", path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_report(report: Report, path: str) -> None:
    """The JSON report at ``path``; one that cannot be written is a warning, not a failed copy."""
    try:
        report.write_json(path)
    except OSError as exc:
        say(f"azcp-cluster: warning: cannot write the JSON report to {path}: {exc.strerror}")


def gbps(nbytes: int, seconds: float) -> str:
    """Bandwidth in the reference's ``x.xx Gb/s`` form (below 0.01, three significant digits:
    a small copy's rate is not ``0.00``)."""
    if seconds <= 0 or nbytes <= 0:
        return "0.00 Gb/s"
    rate = nbytes * 8 / seconds / 1e9
    # The reference's two decimals; below 0.01, three significant digits (never 1e-06).
    decimals = 2 if rate >= 0.01 else 2 - math.floor(math.log10(rate))
    return f"{rate:.{decimals}f} Gb/s"


def _human(nbytes: int, seconds: float | None = None) -> str:
    """The figures in people's units, after a line's exact ones: `` (1.50 GiB at 1.20 GiB/s)``."""
    if nbytes <= 0:
        return ""
    rate = f" at {format_bytes(nbytes / seconds)}/s" if seconds else ""
    return f" ({format_bytes(nbytes)}{rate})"


def _against_cap(report: Report) -> str:
    """With --max-bandwidth: the cap and the rate achieved, in bytes per second (added to ``[download]``)."""
    cap = report.max_bandwidth
    if cap is None:
        return ""
    rate = report.download_rate
    return f" cap={cap:.0f}B/s rate={rate:.0f}B/s ({100 * rate / cap:.1f}% of the cap)"


def _s(count: int) -> str:
    return "" if count == 1 else "s"


# The report's sections in the order they are printed; rank 0 prints each as soon as its stage
# ends (report_sections), so that a person watching a launcher's output sees the run move.
SECTIONS = ("cluster", "list", "diff", "transfer", "verify", "end")


class ReportPrinter:
    """Rank 0's report lines on ``out`` (through ``console`` where given: run/console.py), each
    section once, as soon as its stage has ended.

    Under a launcher the run's output is a pipe or a log: ``[cluster]`` and ``[list]``, known in
    the first second, should not wait for the end of a copy of hours. A reader that went away
    (``| head``, a dead ``tee``) loses the lines, nothing more: a closed pipe must not fail a copy.
    """

    def __init__(self, report: Report, out: TextIO, enabled: bool, console: Console | None = None) -> None:
        self.report = report
        self.out = out
        self.enabled = enabled
        self.console = console
        self.printed: set[str] = set()

    def through(self, section: str) -> None:
        """Print every section up to and including ``section`` not printed yet."""
        if self.enabled:
            upto = SECTIONS[: SECTIONS.index(section) + 1]
            self._print(report_sections(self.report), set(upto))

    def rest(self, failed: bool, after_diff: Sequence[str] = ()) -> None:
        """At the end: the sections not printed yet (a failed run: those of the stages it
        reached), with ``after_diff`` (the dry run's plan) after ``[diff]``."""
        if not self.enabled:
            return
        sections = report_sections(self.report, failed)
        lines = [line for section, line in sections if section not in self.printed]
        if after_diff:
            at = next((i + 1 for i, line in enumerate(lines) if line.startswith("[diff] ")), 0)
            lines[at:at] = after_diff
        self.printed.update(SECTIONS)
        self._write(lines)

    def _print(self, sections: list[tuple[str, str]], wanted: set[str]) -> None:
        lines = [line for section, line in sections if section in wanted and section not in self.printed]
        self.printed.update(wanted)
        self._write(lines)

    def _write(self, lines: list[str], kind: str = "report") -> None:
        if self.console is not None:
            self.console.report(lines, kind)
        else:
            _write_lines(lines, self.out)


def _write_lines(lines: list[str], out: TextIO) -> None:
    """``lines`` on ``out`` in one write (a reader of the first gets them all); a reader gone loses them."""
    if lines:
        with contextlib.suppress(OSError, ValueError):
            out.write("".join(f"{line}\n" for line in lines))
            out.flush()


def report_lines(report: Report, failed: bool = False) -> list[str]:
    """The stable report lines (a contract: scripts parse them).

    ``failed``: the run stopped early; only the lines of the stages it reached (their figures
    so far), the retries and ``[total]`` (none at all if it reached none: an argument refused).
    No ``[download]`` where nothing was downloaded (local SOURCE, no-op rerun), no ``[bcast]`` if none sent.
    """
    return [line for _, line in report_sections(report, failed)]


def report_sections(report: Report, failed: bool = False) -> list[tuple[str, str]]:
    """The report lines, each with its section (:data:`SECTIONS`); see :func:`report_lines`."""
    lines = _lines(report)
    if not failed:
        return lines
    st = report.stages
    reached = {
        "[cluster] ": report.nodes > 0,
        "[list] ": st["list"].seconds > 0,
        "[diff] ": st["diff"].seconds > 0,
        "[download] ": st["download"].seconds > 0 or report.downloaded_bytes > 0,
        "[bcast] ": st["bcast"].seconds > 0 or report.broadcast_bytes > 0,
    }
    if not any(reached.values()):
        return []
    return [(section, line) for section, line in lines if reached.get(line[: line.index(" ") + 1], True)]


def _via(fanout: Mapping[str, object]) -> str:
    """How the fan-out went, for its line: " via chain (1 MiB pieces)", " via ibcast" ("" if unknown)."""
    method = fanout.get("method")
    if method == "chain":
        piece = int(str(fanout["piece"]))
        size = f"{piece >> 20} MiB" if piece % (1 << 20) == 0 else f"{piece / 1024:g} KiB"
        return f" via chain ({size} pieces)"
    return f" via {method}" if method else ""


def _lines(report: Report) -> list[tuple[str, str]]:
    st = report.stages
    head = [
        # "copies", the one word the demo uses too: a copy is one (host, DEST), and several ranks on one
        # host with a DEST each (the demo, the tests) make several copies on one node (issue 41).
        f"[cluster] {report.ranks} rank{_s(report.ranks)} on {report.nodes} host{_s(report.nodes)}, "
        f"{report.writers} {'copy' if report.writers == 1 else 'copies'}, "
        + (
            f"source read by ranks {', '.join(map(str, report.source_readers))}"
            if len(report.source_readers) > 1
            else f"source read by rank {report.source_rank}"
            if report.source_rank is not None
            else f"{report.download_ranks} downloading"
        ),
        f"[list] {report.files} file{_s(report.files)}, {report.bytes} bytes T={st['list'].seconds:.3f}s"
        + _human(report.bytes),
        f"[diff] {report.transfer_files} to transfer ({report.peer_files} peer, {report.azure_files} "
        f"{'azure' if report.source_rank is None else 'source'}), "
        f"{report.skipped_files} skipped"
        + (f", {report.resumed_files} resumed ({report.resumed_bytes} bytes kept)" if report.resumed_files else "")
        + f" T={st['diff'].seconds:.3f}s",
    ]
    lines = list(zip(SECTIONS[:3], head, strict=True))
    if not report.dry_run:
        lines += _moved_lines(report)
    lines.append(("end", f"[total] T={st['total'].seconds:.3f}s"))
    return lines


def _moved_lines(report: Report) -> list[tuple[str, str]]:
    """``[download]``, ``[bcast]``, ``[verify]``, ``[delete]``, retries: each where it has something to say."""
    st = report.stages
    lines = []
    if report.downloaded_bytes:  # (nothing for a local SOURCE, nor for a rerun with nothing to do)
        seconds = st["download"].seconds
        lines.append(
            (
                "transfer",
                f"[download] {report.downloaded_bytes} bytes T={seconds:.3f}s "
                f"BW={gbps(report.downloaded_bytes, seconds)}"
                + _against_cap(report)
                + _human(report.downloaded_bytes, seconds),
            )
        )
    # One node copying from Azure sends nothing: no broadcast line (a local SOURCE's copy is
    # its reader's fan-out, reported as one); nor does a run with nothing to send.
    if report.broadcast_bytes and (report.writers != 1 or report.source_rank is not None or report.source_readers):
        shards, seconds = report.broadcast_shards, st["bcast"].seconds
        lines.append(
            (
                "transfer",
                f"[bcast] {shards} shard{_s(shards)} {report.broadcast_bytes} bytes "
                f"T={seconds:.3f}s BW={gbps(report.broadcast_bytes, seconds)}"
                + _human(report.broadcast_bytes, seconds)
                + _via(report.fanout),
            )
        )
    if files := report.verified_files:
        match = f"all copies match ({report.verified_against_source} against the source's CRC-32)"
        lines.append(("verify", f"[verify] {files} file{_s(files)} T={st['verify'].seconds:.3f}s: {match}"))
    lines += _deleted(report)
    if report.retries:
        causes = ", ".join(f"{k}={v}" for k, v in sorted(report.retry_causes.items()))
        ranks = ", ".join(f"{rank}:{n}" for rank, n in enumerate(report.retries_by_rank) if n)
        lines.append(("end", f"[cluster] retries: {report.retries} ({causes}) by rank {ranks}"))
    return lines


def _deleted(report: Report) -> list[tuple[str, str]]:
    """``--delete``'s line, only when something was removed."""
    if not report.deleted_files:
        return []
    n, copies = report.deleted_distinct_files, report.deleted_copies
    where = f"{copies} cop{'y' if copies == 1 else 'ies'}"
    # Distinct files, as the dry run counts them; the bytes are every copy's.
    line = f"[delete] {n} file{_s(n)} not in SOURCE removed from {where}, {report.deleted_bytes} bytes in all"
    if report.deleted_kept:  # chosen by the walk, changed or gone since: left as they are
        line += f", {report.deleted_kept} changed since and kept"
    return [("end", line + _human(report.deleted_bytes))]
