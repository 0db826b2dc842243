"""The progress bar (azcp_cluster/progress.py): what one line says, and when it is drawn."""

from __future__ import annotations

import io

from azcp_cluster.progress import Progress, wants_progress


def test_the_streaming_bar_shows_fan_out_download_files_rate_and_eta() -> None:
    bar = Progress("transfer", 4 << 20, enabled=True, stream=io.StringIO())
    bar.expect_download(2 << 20)
    bar.expect_files(10)
    bar.started = 100.0
    bar.done, bar.downloaded, bar.files_done = 1 << 20, 1 << 20, 3
    line = bar.line(101.0)  # one second in: 1 MiB/s, 3 MiB to go
    assert line.startswith("transfer  [#######.......................]  25.0% ")
    assert "1.00 MiB / 4.00 MiB 1.00 MiB/s" in line
    assert "downloaded here 1.00 MiB / 2.00 MiB" in line
    assert "3/10 files" in line and "ETA 3s" in line


def test_a_plain_bar_has_no_download_or_files_and_no_eta_when_done() -> None:
    bar = Progress("bcast", 100, enabled=True, stream=io.StringIO())
    bar.started = 0.0
    bar.done = 100
    line = bar.line(2.0)
    assert "100.0%" in line and "downloaded" not in line and "files" not in line and "ETA" not in line


def test_it_draws_at_most_hz_times_a_second_and_ends_its_line() -> None:
    out = io.StringIO()
    bar = Progress("bcast", 1000, enabled=True, stream=out, hz=1e-3)
    bar.last = -1e9  # long ago: the first add draws
    for _ in range(50):
        bar.add(1, files=1)
    assert out.getvalue().count("\r") == 1  # the first add draws; the next may not for a long time
    bar.add(950)  # the end always draws
    assert out.getvalue().count("\r") == 2 and bar.files_done == 50
    bar.close()
    assert out.getvalue().endswith("\n")


def test_nothing_is_drawn_when_disabled_or_off_rank_zero() -> None:
    out = io.StringIO()
    bar = Progress("bcast", 10, enabled=False, stream=out)
    bar.add(10)
    bar.close()
    assert out.getvalue() == ""
    assert not wants_progress(True, 1, io.StringIO()) and not wants_progress(True, 0, io.StringIO())


class _Gone(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(5, "Input/output error")


def test_a_terminal_that_is_gone_ends_the_bar_not_the_copy() -> None:
    bar = Progress("bcast", 10, enabled=True, stream=_Gone())
    bar.add(5)  # the write fails: the bar turns itself off
    assert not bar.enabled
    bar.add(5)
    bar.close()
