"""The engine: the stages in order, each ending in an agreement of all ranks.

setup -> list -> diff -> plan -> schedule -> allocate -> transfer -> sync -> [verify] ->
rename -> record -> report. Each stage is a module of ``azcp_cluster.stages`` that takes
the frozen results of the stages before it and returns its own; this file owns only the
order and the two printed outputs (the dry run's plan and the report).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

from azcp_cluster.core.comm import Comm
from azcp_cluster.core.config import Config, format_bytes
from azcp_cluster.core.errors import AzcpError, ReportPathError
from azcp_cluster.core.plan import Plan, plan_transfers
from azcp_cluster.run import collector, dryrun, figures
from azcp_cluster.run.cluster import Cluster
from azcp_cluster.run.console import Console
from azcp_cluster.run.report import Report, ReportPrinter, write_json_report
from azcp_cluster.run.summary import counted, summary_line
from azcp_cluster.stages import allocate, finish, scheduling, setup, survey, transfer
from azcp_cluster.stages.context import RunContext, log_path_for

if TYPE_CHECKING:
    from azcp_cluster.run.interrupts import Interrupts


# Rounds of sending again what changed while it was read, before the run gives up on the file.
SEND_AGAIN = 1


def _attach(error: AzcpError, report: Report) -> AzcpError:
    error.report = report  # type: ignore[attr-defined]
    report.failed(error.exit_code, error.one_line())
    return error


def run(
    cfg: Config,
    comm: Comm,
    *,
    env: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    out: TextIO | None = None,
    host: str | None = None,
    credential: Any = None,
    interrupts: Interrupts | None = None,
) -> Report:
    """Run every stage on this rank (collectively with the others in ``comm``).

    Returns the report on every rank; raises the same typed :class:`AzcpError` on every
    rank if any rank fails (the error carries the partial report as ``.report``).
    ``credential`` (a TokenCredential or a SAS) comes before the environment's.
    """
    env = os.environ if env is None else env
    out = sys.stdout if out is None else out
    # interrupts: the CLI's SIGINT/SIGTERM recorder; a peer timeout of 0 turns the pulse off
    cluster = Cluster(comm, clock, interrupts, cfg.peer_timeout or None)
    report = Report(ranks=cluster.size, dry_run=cfg.dry_run, max_bandwidth=cfg.max_bandwidth)
    started = clock()
    host = host or socket.gethostname()
    console = Console(cfg.verbosity, log_path_for(cfg.log_file, cluster.rank, host), out, cluster.rank)
    ctx = RunContext(cfg, cluster, report.record, env, wall, console, host, started, credential)
    # Rank 0 prints each report section as its stage ends (the rest at the end, below).
    lines = ReportPrinter(report, out, enabled=cluster.rank == 0, console=console)
    failed: AzcpError | None = None
    plan_lines: list[str] = []
    agreed = False  # every rank ends here together: an agreed outcome, not one rank's bug
    try:
        plan_lines = execute(ctx, report, lines)
        agreed = True
    except AzcpError as exc:
        failed = _attach(exc, report)
        agreed = True
    finally:
        _end(ctx, failed is not None, agreed)
        # Every agreement carried each rank's timeline and peak memory: a failed run reports them too.
        report.ended(clock() - started, cluster.timeline, cluster.origins, cluster.peak_rss)
    # Once DEST's lock is released and removed: a launcher that dies of a reader gone away
    # (`mpiexec ... | head`) finds nothing of the run left to clean up. The JSON report first,
    # then the lines (on a failure, those of the stages it reached; the CLI prints the error
    # line after them), each in one write.
    if cluster.rank == 0:
        _rank0_end(cfg, report, lines, console, failed, plan_lines)
    if failed is not None:
        console.log([failed.one_line()])  # the CLI says it on stderr; the log has it too
    console.close(ctx.dest_identity)
    if failed is not None:
        raise failed from None
    return report


def _end(ctx: RunContext, failed: bool, agreed: bool) -> None:
    """Close the run on this rank, whatever happened: its handles, a failed run's DEST made and
    still empty, the pulse (``agreed``: every rank ends here together), the collector's hold."""
    ctx.cluster.interrupts.on_first = None  # the outcome is decided: the report says it
    try:
        try:
            ctx.close()
            ctx.let_dest_be(remove=failed)
        finally:
            # Agreed: the last pulses, as every rank ends. Else this rank leaves alone (the
            # CLI then ends the job with MPI_Abort): waiting for the others' would not end.
            ctx.cluster.close(agreed)
    finally:
        ctx.heap.end()  # what the run froze goes back to the collector


def _report_at_signal(report: Report, path: str, cluster: Cluster, started: float) -> Callable[[int], None]:
    """What rank 0 does at its first SIGINT or SIGTERM: write the JSON report as it stands, with the signal's code.

    The ranks then agree to stop and rank 0 writes the report again, but a launcher may kill
    every rank first (MPICH's mpiexec at a second Ctrl-C, Open MPI's 0.25 s after its SIGTERM);
    the report on disk then still says how the run ended. Runs in the signal handler.
    """
    from azcp_cluster.dest import localfs  # noqa: F401  (imported now, never first inside a signal handler)
    from azcp_cluster.run.interrupts import signal_error
    from azcp_cluster.run.report import write_json_document

    def write(signum: int) -> None:
        # Quick (Open MPI kills 0.25 s after its SIGTERM): the fields as they stand, no fsync;
        # the report written once the ranks agree is the durable one.
        error = signal_error(signum, 0)
        doc = report.to_json()
        doc["exit_code"], doc["error"] = error.exit_code, error.one_line()
        doc["stages"]["total"]["seconds"] = cluster.clock() - started
        doc["peak_rss_bytes"] = cluster.peak_rss  # as of the last agreement
        with contextlib.suppress(OSError):
            write_json_document(doc, path, durable=False)

    return write


def execute(ctx: RunContext, report: Report, lines: ReportPrinter) -> list[str]:
    """Every stage in order on this rank; each hands a frozen result to the next.

    Returns the dry run's ``[plan]`` lines (rank 0), which the report prints after ``[diff]``.
    """
    cfg = ctx.cfg
    place = setup.setup(ctx)
    ctx.console.open_log(ctx.dest_identity)  # (setup refused one inside DEST)
    lines.through("cluster")
    if ctx.rank == 0 and cfg.json_path:  # its place checked by setup (not inside DEST)
        ctx.cluster.interrupts.on_first = _report_at_signal(report, cfg.json_path, ctx.cluster, ctx.started)
    # The listing, the plan and the schedule: up to millions of objects kept for the run.
    with collector.paused() as ctx.heap:
        listed = survey.list_source(ctx, place)
        lines.through("list")
        diff = survey.diff(ctx, place, listed)
        lines.through("diff")
        topo = place.topo
        owners = list(place.owners)
        sizes = [f.size for f in listed.listing.files]
        plan = plan_transfers(
            sizes,
            diff.holders,
            topo.size,
            scheduling.shard_size_for(cfg, place, sum(sizes)),
            owners=owners,
            copies=topo.groups,
            partial=diff.partial,  # a resumed run: only the ranges some copy lacks
            receivers=list(topo.leaders),
        )
        report.record(figures.Planned(tuple(plan.loads()), plan.spread(owners), plan.shard_count))
        # The fan-out runs between leaders: a shard goes out from its owner's leader.
        schedule = None if cfg.dry_run else scheduling.schedule_for(cfg, ctx.local, place, plan)
    if schedule is None:
        return plan_lines(ctx, list(diff.transfer), plan) + dry_run_lines(ctx, listed, diff)
    prepared = allocate.allocate(ctx, place, listed, diff, plan, schedule)
    moved = transfer.move(ctx, place, prepared)
    for _ in range(SEND_AGAIN):
        if not moved.changed:
            break
        # A local SOURCE's file changed while it was read: the reader reads it again and every
        # node receives it anew (a torn copy never reaches a final name: the rename comes after).
        prepared = allocate.resend(ctx, place, moved, prepared)
        moved = transfer.move(ctx, place, prepared, earlier=moved)
    if moved.changed:  # changed again while read again: it is being written to
        raise transfer.changed_twice(ctx, moved)
    del prepared  # the fan-out's slots are released; nothing below needs them
    lines.through("transfer")
    finish.sync(ctx, place, moved)
    # Before the rename: a mismatch leaves no final name.
    verified = finish.verify(ctx, place, moved) if cfg.verify else {}
    lines.through("verify")
    _complete(ctx, place, moved, verified)
    return []


def _rank0_end(
    cfg: Config, report: Report, lines: ReportPrinter, console: Console, failed: AzcpError | None, plan: list[str]
) -> None:
    """Rank 0's end: the JSON report, then the lines not printed yet (``plan``: a dry run's),
    then the one summary line for people."""
    if cfg.json_path and not isinstance(failed, ReportPathError):
        write_json_report(report, cfg.json_path)
    lines.rest(failed is not None, plan)
    summary = None if failed is not None else summary_line(report)
    if summary is not None:  # the last line, for people (-q keeps it alone)
        console.report([summary], "summary")
    elif cfg.dry_run and failed is None and not console.shows("report"):
        # -q keeps what a dry run is for, each file's action and the total (logged above).
        console.report([line for line in plan if not line.startswith("[plan] ")], "summary", logged=True)


def _complete(
    ctx: RunContext, place: setup.Placement, moved: transfer.Transferred, verified: Mapping[int, str]
) -> None:
    """Every byte is durable everywhere (and verified): the renames and the manifest follow, and
    a signal from now on changes nothing (a stop halfway would leave a complete copy reported
    as stopped, with no manifest); then ``--delete``'s removals, past the record's agreement:
    every node's copy is complete and recorded."""
    ctx.cluster.interrupts.seal()
    finish.rename(ctx, place, moved)
    finish.record(ctx, place, moved, verified)
    if ctx.cfg.delete:
        finish.delete(ctx, place, moved)


def dry_run_lines(ctx: RunContext, listed: survey.Listed, diff: survey.Diff) -> list[str]:
    """The dry run's line per file and its total, on rank 0 (run/dryrun.py)."""
    if ctx.rank != 0:
        return []
    files = listed.listing.files
    return dryrun.file_lines(files, diff.transfer, diff.holders, diff.partial, diff.stale_by)


def plan_lines(ctx: RunContext, transfer: list[int], plan: Plan) -> list[str]:
    """The dry run's plan, on rank 0: files and bytes per rank, and the spread."""
    if ctx.rank != 0:
        return []
    counts = plan.files_per_rank()
    loads = plan.loads()
    return [
        f"[plan] {counted(len(transfer), 'file')}, {counted(plan.shard_count, 'shard')} over "
        f"{counted(plan.nranks, 'rank')}",
        *(
            f"[plan] rank {rank}: {counted(counts[rank], 'file')}, {loads[rank]} bytes ({format_bytes(loads[rank])})"
            for rank in range(plan.nranks)
        ),
        f"[plan] spread {plan.spread() * 100:.2f}% (busiest rank over the mean)",
    ]
