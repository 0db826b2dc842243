"""What reaches the terminal and the log file (azcp_cluster/run/console.py): -q, -v, --log-file,
the libraries' log records, and --progress bar without a terminal."""

from __future__ import annotations

import io
import logging
import os
import re
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.core.errors import UsageError
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.options import config_from_args
from azcp_cluster.run.console import Console, notice, say
from azcp_cluster.run.progress import BAR_NEEDS_A_TERMINAL
from azcp_cluster.stages.context import log_path_for
from tests.conftest import run_cli

IMDS = "ImdsCredential.get_token failed: ManagedIdentityCredential authentication unavailable"


def _library_warning() -> None:
    logging.getLogger("azure.identity._credentials.imds").warning(IMDS)
    logging.getLogger("azure.core.pipeline").info("Request URL: 'https://x.blob.core.windows.net/c'")


@pytest.mark.parametrize("verbosity", ["quiet", "normal"])
def test_the_libraries_log_lines_are_silenced_by_default(verbosity: str, capfd: pytest.CaptureFixture[str]) -> None:
    console = Console(verbosity, None, io.StringIO(), 0)
    try:
        _library_warning()  # before: logging's last-resort handler printed it on stderr
    finally:
        console.close("/nonexistent-dest")
    assert capfd.readouterr().err == ""


HEADER = re.compile(r"# azcp-cluster \S+, rank \d+, log opened \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(pid \d+\)")


def _logged(path: Path) -> list[str]:
    """A log file's lines after its header, which each run writes first (appended runs told apart)."""
    first, *rest = path.read_text().splitlines()
    assert HEADER.fullmatch(first), first
    return rest


def test_verbose_shows_them_and_the_log_file_gets_every_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "run.log"
    out = io.StringIO()
    console = Console("verbose", str(log), out, 0)
    try:
        console.report(["[cluster] 2 nodes"])  # before the log opens: kept for it
        console.open_log(str(tmp_path / "dest"))
        _library_warning()
        console.report(["azcp-cluster: 1 file"], "summary")
    finally:
        console.close(str(tmp_path / "dest"))
    err = capfd.readouterr().err
    assert f"azcp-cluster: rank 0: warning azure.identity._credentials.imds: {IMDS}" in err
    assert "azure.core.pipeline: Request URL" in err  # INFO and up under -v
    text = _logged(log)
    assert text[0] == "[cluster] 2 nodes" and text[-1] == "azcp-cluster: 1 file"
    assert any(IMDS in line for line in text) and any("Request URL" in line for line in text)
    assert out.getvalue() == "[cluster] 2 nodes\nazcp-cluster: 1 file\n"
    assert logging.getLogger("azure").handlers == []  # the loggers as they were


def test_quiet_keeps_the_summary_and_the_log_keeps_all(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    log, out = tmp_path / "run.log", io.StringIO()
    console = Console("quiet", str(log), out, 0)
    console.open_log(str(tmp_path / "dest"))
    console.report(["[cluster] 2 nodes", "[total] T=1.000s"])
    console.note(BAR_NEEDS_A_TERMINAL)
    say("azcp-cluster: warning: O_DIRECT refused")  # any module's warning: on stderr, and in the log
    notice("azcp-cluster: rank 1: retrying (1/5) in 0.5 s: HTTP 503")  # a notice: in the log only
    console.report(["azcp-cluster: 1 file"], "summary")
    console.close(str(tmp_path / "dest"))
    say("azcp-cluster: warning: after the run")  # not in a closed log
    assert out.getvalue() == "azcp-cluster: 1 file\n"
    assert capfd.readouterr().err.splitlines() == ["azcp-cluster: warning: O_DIRECT refused",
                                                   "azcp-cluster: warning: after the run"]  # fmt: skip
    assert _logged(log) == ["[cluster] 2 nodes", "[total] T=1.000s", BAR_NEEDS_A_TERMINAL,
                                            "azcp-cluster: warning: O_DIRECT refused",
                                            "azcp-cluster: rank 1: retrying (1/5) in 0.5 s: HTTP 503",
                                            "azcp-cluster: 1 file"]  # fmt: skip
    assert console.progress_mode("bar") == "none"


def test_a_log_file_is_expanded_like_dest_and_without_rank_written_by_rank_0_alone() -> None:
    assert log_path_for("/logs/{host}-{rank}.log", 3, "n7") == "/logs/n7-3.log"
    assert log_path_for("/logs/run.log", 0, "n7") == "/logs/run.log"
    assert log_path_for("/logs/run.log", 3, "n7") is None
    assert log_path_for(None, 0, "n7") is None


def test_quiet_and_verbose_together_are_refused() -> None:
    with pytest.raises(UsageError, match="contradict"):
        config_from_args(["/src", "/dest", "-q", "--verbose"])
    assert config_from_args(["/src", "/dest", "-v"]).verbosity == "verbose"
    assert config_from_args(["/src", "/dest", "--quiet"]).verbosity == "quiet"
    assert config_from_args(["/src", "/dest"]).verbosity == "normal"


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.bin").write_bytes(pseudo_random(MiB + i, f"console{i}"))
    return src


def test_under_mpiexec_quiet_prints_the_summary_alone_and_the_log_has_the_rest(tmp_path: Path) -> None:
    src = _source(tmp_path)
    log = tmp_path / "log-{rank}.txt"
    result = run_cli([str(src), str(tmp_path / "{rank}"), "-q", "--log-file", str(log)], n=2)
    assert result.returncode == 0, result.output
    assert result.stdout.splitlines() == [
        "azcp-cluster: 3 files, 3.00 MiB to 2 copies (6.00 MiB written) in " + result.stdout.split(" in ", 1)[1].strip()
    ], result.output
    assert result.stderr == ""
    logged = _logged(tmp_path / "log-0.txt")
    assert [line.split()[0] for line in logged] == ["[cluster]", "[list]", "[diff]", "[bcast]", "[total]",
                                                    "azcp-cluster:"]  # fmt: skip
    assert logged[-1] == result.stdout.strip()  # a local SOURCE: no "[download] 0 bytes" line


def test_under_mpiexec_progress_bar_says_once_that_it_prints_lines(tmp_path: Path) -> None:
    src = _source(tmp_path)
    result = run_cli([str(src), str(tmp_path / "{rank}"), "--progress", "bar"], n=2)
    assert result.returncode == 0, result.output
    assert result.stderr.count(BAR_NEEDS_A_TERMINAL) == 1, result.stderr
    assert result.stdout.splitlines()[-1].startswith("azcp-cluster: 3 files, 3.00 MiB to 2 copies ")


def test_a_log_file_inside_dest_is_refused(tmp_path: Path) -> None:
    src = _source(tmp_path)
    dest = tmp_path / "dest"
    result = run_cli([str(src), str(dest / "{rank}"), "--log-file", str(dest / "0" / "run.log")], n=2)
    assert result.returncode == 2, result.output
    assert "--log-file" in result.stderr and "lies inside DEST" in result.stderr
    assert not (dest / "0" / "run.log").exists()
    assert "[total]" not in result.stdout  # no report line for a run refused at its start


@pytest.mark.parametrize("where", ["another-rank's-dest", "source", "the-json-report"])
def test_a_log_file_where_it_would_be_copied_or_overwritten_is_refused(tmp_path: Path, where: str) -> None:
    """Without ``{rank}`` rank 0 alone writes the log, and every rank checks it, as the JSON
    report: not in node 1's DEST (the copy would meet it there), not in a local SOURCE (its lines
    copied as data), not the JSON report's file (one would overwrite the other)."""
    src = _source(tmp_path)
    dest = tmp_path / "dest"
    log = {"another-rank's-dest": dest / "1" / "run.log", "source": src / "run.log",
           "the-json-report": tmp_path / "report.json"}[where]  # fmt: skip
    args = [str(src), str(dest / "{rank}"), "--log-file", str(log), "--json", str(tmp_path / "report.json")]
    result = run_cli(args, n=2)
    assert result.returncode == 2, result.output
    assert "--log-file" in result.stderr, result.stderr
    assert not log.exists() or where == "the-json-report"
    assert not (src / "run.log").exists()


@pytest.mark.parametrize("kind", ["link", "dangling-link", "fifo"])
def test_a_log_file_is_never_written_through_a_link_nor_into_a_fifo(tmp_path: Path, kind: str) -> None:
    """A shared /tmp may hold a link planted at the log's name: never followed (the file it
    names neither appended to nor made); a FIFO would block the run in open, deaf to signals.
    Each is a warning, and the copy completes."""
    src = _source(tmp_path)
    victim = tmp_path / "victim"
    log = tmp_path / "run.log"
    if kind == "fifo":
        os.mkfifo(log)
    else:
        if kind == "link":
            victim.write_text("precious\n")
        log.symlink_to(victim)
    result = run_cli([str(src), str(tmp_path / "{rank}"), "--log-file", str(log)], n=0, timeout=60)
    assert result.returncode == 0, result.output
    assert f"warning: cannot write the log to {log}" in result.stderr, result.stderr
    if kind == "link":
        assert victim.read_text() == "precious\n"
    else:
        assert not victim.exists()
