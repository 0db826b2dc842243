"""The engine: the stages in order, each ending in an agreement of all ranks.

setup -> list -> diff -> plan -> schedule -> allocate -> transfer -> sync -> [verify] ->
rename -> record -> report. Each stage is a module of ``azcp_cluster.stages`` that takes
the frozen results of the stages before it and returns its own; this file owns only the
order and the two printed outputs (the dry run's plan and the report).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

from azcp_cluster import collector
from azcp_cluster.cluster import Cluster
from azcp_cluster.config import Config, format_bytes
from azcp_cluster.errors import AzcpError
from azcp_cluster.plan import Plan, plan_transfers
from azcp_cluster.report import Report, report_lines
from azcp_cluster.stages import allocate, finish, setup, survey, transfer
from azcp_cluster.stages.context import RunContext

if TYPE_CHECKING:
    from azcp_cluster.interrupts import Interrupts


def _attach(error: AzcpError, report: Report) -> AzcpError:
    error.report = report  # type: ignore[attr-defined]
    report.exit_code = error.exit_code
    report.error = error.one_line()
    return error


def run(
    cfg: Config,
    comm: Any,
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
    cluster = Cluster(comm, clock, interrupts)  # interrupts: the CLI's SIGINT/SIGTERM recorder
    report = Report(ranks=cluster.size, dry_run=cfg.dry_run)
    started = clock()
    ctx = RunContext(cfg, cluster, report, env, wall, out, host or socket.gethostname(), started, credential)
    try:
        execute(ctx)
    except AzcpError as exc:
        report.stages["total"].seconds = clock() - started
        raise _attach(exc, report) from None
    finally:
        try:
            ctx.close()
            cluster.close()
        finally:
            ctx.heap.end()  # what the run froze goes back to the collector
    return report


def execute(ctx: RunContext) -> None:
    """Every stage in order on this rank; each hands a frozen result to the next."""
    cfg = ctx.cfg
    place = setup.setup(ctx)
    # The listing, the plan and the schedule: up to millions of objects kept for the run.
    with collector.paused() as ctx.heap:
        listed = survey.list_source(ctx, place)
        diff = survey.diff(ctx, place, listed)
        topo = place.topo
        owners = list(place.readers) if ctx.local else list(topo.downloaders)
        plan = plan_transfers(
            [f.size for f in listed.listing.files],
            diff.holders,
            topo.size,
            cfg.shard_size,
            owners=owners,
            copies=topo.groups,
            partial=diff.partial,  # a resumed run: only the ranges some copy lacks
            receivers=list(topo.leaders),
        )
        report = ctx.report
        report.plan_loads = plan.loads()
        report.plan_spread = plan.spread(owners)
        report.broadcast_shards = plan.shard_count
        # The fan-out runs between leaders: a shard goes out from its owner's leader.
        schedule = None if cfg.dry_run else allocate.schedule_for(ctx, place, plan)
    if schedule is None:
        print_plan(ctx, list(diff.transfer), plan)
        print_report(ctx)
        return
    prepared = allocate.allocate(ctx, place, listed, diff, plan, schedule)
    moved = transfer.move(ctx, place, listed, diff, plan, schedule, prepared)
    del prepared  # the fan-out's slots are released; nothing below needs them
    finish.sync(ctx, place, moved)
    # Before the rename: a mismatch leaves no final name.
    verified = finish.verify(ctx, place, moved) if cfg.verify else {}
    finish.rename(ctx, place, moved)
    finish.record(ctx, place, moved, verified)
    print_report(ctx)


def print_plan(ctx: RunContext, transfer: list[int], plan: Plan) -> None:
    """The dry run's plan, on rank 0: files and bytes per rank, and the spread."""
    if ctx.rank != 0:
        return
    counts = plan.files_per_rank()
    loads = plan.loads()
    print(f"[plan] {len(transfer)} files, {plan.shard_count} shards over {plan.nranks} ranks", file=ctx.out)
    for rank in range(plan.nranks):
        print(
            f"[plan] rank {rank}: {counts[rank]} files, {loads[rank]} bytes ({format_bytes(loads[rank])})",
            file=ctx.out,
        )
    print(f"[plan] spread {plan.spread() * 100:.2f}% (busiest rank over the mean)", file=ctx.out)
    ctx.out.flush()


def print_report(ctx: RunContext) -> None:
    """The report's lines, on rank 0 (after the total time is set on every rank)."""
    ctx.report.stages["total"].seconds = ctx.cluster.clock() - ctx.started
    if ctx.rank != 0:
        return
    for line in report_lines(ctx.report):
        print(line, file=ctx.out)
    ctx.out.flush()
