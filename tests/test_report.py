"""The report's lines (azcp_cluster/run/report.py): people's units beside the exact figures, what a
one-node run says, and each section printed once, as soon as its stage ends."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace
from typing import Any

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.core.errors import ListError
from azcp_cluster.run.cluster import Cluster, StageOutcome, error_payload, peak_rss
from azcp_cluster.run.report import Report, ReportPrinter, StageFigures, gbps, report_lines
from azcp_cluster.run.summary import summary_line


def _report(writers: int, **fields: object) -> Report:
    report = Report(ranks=writers, nodes=writers, writers=writers, download_ranks=writers, files=3, bytes=512 * MiB)
    report.downloaded_bytes = report.broadcast_bytes = 512 * MiB
    report.broadcast_shards = 3
    report.stages["list"] = StageFigures(0.05, 0)
    report.stages["diff"] = StageFigures(0.01, 0)
    report.stages["download"] = StageFigures(0.5, 512 * MiB)
    report.stages["bcast"] = StageFigures(2.0, 512 * MiB)
    report.stages["total"] = StageFigures(2.5, 0)
    for name, value in fields.items():
        setattr(report, name, value)
    return report


def test_exact_figures_first_then_people_units() -> None:
    lines = report_lines(_report(2))
    assert "[list] 3 files, 536870912 bytes T=0.050s (512.00 MiB)" in lines
    assert "[download] 536870912 bytes T=0.500s BW=8.59 Gb/s (512.00 MiB at 1.00 GiB/s)" in lines
    assert "[bcast] 3 shards 536870912 bytes T=2.000s BW=2.15 Gb/s (512.00 MiB at 256.00 MiB/s)" in lines


def test_a_small_copy_has_a_rate_not_zero() -> None:
    assert gbps(1000, 2.0) == "0.00000400 Gb/s"
    assert gbps(1_000_000, 1.0) == "0.00800 Gb/s"
    assert gbps(20_000_000, 1.0) == "0.16 Gb/s"
    assert gbps(10**9, 1.0) == "8.00 Gb/s"
    assert gbps(0, 1.0) == gbps(10, 0.0) == "0.00 Gb/s"


def test_one_node_from_azure_has_no_broadcast_line_but_a_local_source_does() -> None:
    one = report_lines(_report(1))
    assert not any(line.startswith("[bcast]") for line in one) and any(line.startswith("[download]") for line in one)
    local = report_lines(_report(1, source_rank=0, download_ranks=0))
    assert any(line.startswith("[bcast]") for line in local)
    assert any(line.startswith("[bcast]") for line in report_lines(_report(2)))


def test_each_section_is_printed_once_as_its_stage_ends_and_the_rest_at_the_end() -> None:
    report, out = _report(2), io.StringIO()
    printer = ReportPrinter(report, out, enabled=True)
    printer.through("cluster")
    assert out.getvalue().splitlines() == [report_lines(report)[0]]
    printer.through("diff")
    printer.through("diff")  # once
    assert [line.split()[0] for line in out.getvalue().splitlines()] == ["[cluster]", "[list]", "[diff]"]
    report.stages["total"] = StageFigures(9.0, 0)  # the end's figures are those at the end
    printer.rest(failed=False, after_diff=["[plan] x"])  # the dry run's plan: at once after [diff]
    got = out.getvalue().splitlines()
    assert [line.split()[0] for line in got] == ["[cluster]", "[list]", "[diff]", "[plan]", "[download]",
                                                 "[bcast]", "[total]"]  # fmt: skip
    assert got[-1] == "[total] T=9.000s"  # the summary line follows, from pipeline.run


def test_a_failed_run_prints_the_rest_it_reached_and_other_ranks_print_nothing() -> None:
    report, out = _report(2), io.StringIO()
    report.stages["download"] = StageFigures()
    report.stages["bcast"] = StageFigures()
    report.downloaded_bytes = report.broadcast_bytes = 0
    printer = ReportPrinter(report, out, enabled=True)
    printer.through("list")
    printer.rest(failed=True)
    assert [line.split()[0] for line in out.getvalue().splitlines()] == ["[cluster]", "[list]", "[diff]", "[total]"]
    silent = io.StringIO()
    other = ReportPrinter(report, silent, enabled=False)
    other.through("diff")
    other.rest(failed=False)
    assert silent.getvalue() == ""


def test_no_line_with_nothing_to_say_and_singulars_right() -> None:
    # A local SOURCE downloads nothing: no [download] line (it said "0 bytes T=0.000s").
    local = report_lines(_report(2, source_rank=0, download_ranks=0, downloaded_bytes=0))
    tags = [line.split()[0] for line in local]
    assert "[download]" not in tags and "[bcast]" in tags
    # A rerun with nothing to do: neither [download] nor "[bcast] 0 shards".
    rerun = report_lines(_report(2, downloaded_bytes=0, broadcast_bytes=0, broadcast_shards=0, skipped_files=3))
    assert [line.split()[0] for line in rerun] == ["[cluster]", "[list]", "[diff]", "[total]"], rerun
    one = report_lines(_report(1, files=1, ranks=1, verified_files=1, broadcast_shards=1, source_rank=0))
    assert one[0].startswith("[cluster] 1 rank on 1 host, 1 copy, ") and one[1].startswith("[list] 1 file, ")
    assert any(line.startswith("[bcast] 1 shard ") for line in one)
    assert any(line.startswith("[verify] 1 file ") for line in one)


def test_a_run_that_reached_no_stage_prints_no_report_line() -> None:
    # An argument refused inside the run (--json inside DEST): its error line alone, no [total].
    report, out = Report(ranks=4), io.StringIO()
    report.stages["total"] = StageFigures(0.01, 0)
    ReportPrinter(report, out, enabled=True).rest(failed=True)
    assert out.getvalue() == ""


def test_one_summary_line_at_the_end() -> None:
    copied = _report(4, transfer_files=3)
    written = "(2.00 GiB written)"
    assert summary_line(copied) == f"azcp-cluster: 3 files, 512.00 MiB to 4 copies {written} in 2.50 s, 0 retries"
    one = _report(4, nodes=1, files=1, bytes=10, transfer_files=1, retries=1)
    assert summary_line(one) == "azcp-cluster: 1 file, 10 B to 4 copies (40 B written) in 2.50 s, 1 retry"
    partly = _report(4, transfer_files=2, skipped_files=1, skipped_bytes=12 * MiB, peer_files=1)
    assert summary_line(partly) == (
        "azcp-cluster: 2 files, 500.00 MiB to 4 copies in 2.50 s, 0 retries (1 file already present)"
    )
    nothing = _report(4, skipped_files=3)
    assert summary_line(nothing) == "azcp-cluster: nothing to do: 3 files already present in 4 copies"
    assert summary_line(_report(4, transfer_files=3, exit_code=5, error="x")) is None
    assert summary_line(_report(4, transfer_files=3, dry_run=True)) is None


class _ThreeRanks:
    """Rank 0 of three, over a fake communicator: the others' parts of each allgather are given."""

    def __init__(self, others: list[tuple[Any, ...]]) -> None:
        self.others = others

    def Get_rank(self) -> int:  # mpi4py's names
        return 0

    def Get_size(self) -> int:
        return 3

    def Dup(self) -> _ThreeRanks:
        return self

    def Free(self) -> None:
        pass

    def Ibarrier(self) -> Any:
        return SimpleNamespace(Test=lambda: True)

    def allgather(self, mine: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return [mine, *self.others]


def test_every_agreement_carries_the_peak_memory_of_every_rank_a_failed_one_too() -> None:
    # Rank 1 failed the stage and holds 5 GiB at its peak: the agreement raises its error and
    # the cluster still knows that peak (pipeline.run puts it in the report of the failed run).
    small = (0.1, None, {}, False, [], 0.0, 1024)
    failed = (0.1, error_payload(ListError("cannot list", rank=1)), {}, False, [], 0.0, 5 << 30)
    comm = _ThreeRanks([failed, small])
    cluster = Cluster(comm, time.monotonic)
    with pytest.raises(ListError, match="cannot list"):
        cluster.conclude(time.monotonic(), StageOutcome())
    assert cluster.peak_rss == 5 << 30
    comm.others = [small, small]  # the largest of the run so far, not of the last agreement alone
    cluster.conclude(time.monotonic(), StageOutcome())
    assert cluster.peak_rss == 5 << 30
    cluster.close()
    # This rank's own peak counts: here the largest.
    alone = Cluster(_ThreeRanks([small, small]), time.monotonic)
    alone.conclude(time.monotonic(), StageOutcome())
    assert alone.peak_rss == peak_rss() > 16 << 20
    alone.close()
