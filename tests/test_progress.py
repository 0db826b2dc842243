"""Progress (azcp_cluster/run/progress.py): the bar on a terminal, status lines elsewhere, and what
a person sees under a launcher (stage lines as their stages end)."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.devtools.demo import checkpoint_like
from azcp_cluster.run.progress import LINE_SECONDS, LINE_STEP, Progress, resolve_mode
from tests.conftest import MPI_TIMEOUT, clean_env, mpiexec_path


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _bar(total: int, width: int = 200, mode: str = "bar") -> tuple[Progress, io.StringIO, _Clock]:
    out, clock = io.StringIO(), _Clock()
    return Progress("transfer", total, mode, stream=out, clock=clock, width=width), out, clock


def test_percent_bytes_rate_and_eta_come_from_one_measure_and_the_files_from_the_listing() -> None:
    bar, _, clock = _bar(4 * MiB)
    bar.expect_files(10, present=2)  # the listing's 10: 2 already present (or empty) from the start
    for _ in range(4):  # 0.5 MiB a second, steadily, for 4 s
        clock.now += 1.0
        bar.add(MiB // 2, files=1)
    line = bar.bar(clock.now)
    assert line.startswith("transfer [") and " 50.0%, 2.00 MiB / 4.00 MiB, 512.00 KiB/s, ETA 4s, 6/10 files" in line
    assert "downloaded" not in line
    assert bar.bar(clock.now).split("] ", 1)[1].strip() == bar.status(clock.now).split("transfer ", 1)[1].strip()


def test_no_eta_before_two_seconds_of_bytes_nor_while_the_rate_is_unsteady() -> None:
    bar, _, clock = _bar(96 * MiB)
    clock.now += 3.0  # nothing moved for 3 s (the first transfer's download)
    bar.add(37)  # a first frame's few bytes promised 35 hours
    clock.now += 0.2
    assert bar.eta(clock.now) is None and "ETA" not in bar.bar(clock.now)
    for _ in range(9):  # 1.91 s since the first bytes, at a steady MiB/s: still under 2 s
        clock.now += 0.19
        bar.add(MiB // 5)
    assert bar.eta(clock.now) is None
    clock.now += 0.3
    bar.add(MiB // 5)
    assert bar.eta(clock.now) is not None  # 2 s of a steady rate
    clock.now += 4.0  # then a stall: the last half of the window much slower than the window
    bar.add(1)
    assert bar.eta(clock.now) is None and "ETA" not in bar.bar(clock.now)


@pytest.mark.parametrize("width", [40, 60, 80, 120, 160])
def test_the_bar_fits_the_terminal_with_one_column_spare(width: int) -> None:
    bar, _, clock = _bar(400 * 1024 * MiB, width=width)
    bar.expect_files(123_456)
    for _ in range(30):
        clock.now += 1.0
        bar.add(100 * MiB, files=333)
    line = bar.bar(clock.now)
    assert len(line) <= width - 1, line
    assert "%, " in line and "ETA" in line  # the least useful parts go first, the ETA last of them
    if width >= 120:
        assert "[" in line and "files" in line


def test_drawn_at_most_four_times_a_second_and_ended_clean() -> None:
    bar, out, clock = _bar(1000)
    for _ in range(50):
        clock.now += 0.01
        bar.add(1, files=1)
    assert out.getvalue().count("\r") == 2  # 0.5 s: at 0.01 s (the first), then 0.25 s later
    clock.now += 1.0
    bar.add(950)
    bar.close()
    text = out.getvalue()
    last = text.rsplit("\r", 1)[1]
    assert text.endswith("\x1b[K\n") and "100.0%" in last and "ETA" not in last and bar.files_done == 50


def test_status_lines_each_step_or_each_interval_and_a_last_one() -> None:
    lines, out, clock = _bar(100, mode="lines")
    clock.now += 0.5
    lines.add(10)  # 10 % but within the first second: not yet
    assert out.getvalue() == ""
    clock.now += 0.6
    lines.add(1)  # 11 %, a second in: a line (no ETA yet: 0.6 s of bytes moving)
    clock.now += 1.0
    lines.add(int(LINE_STEP * 100) - 1)  # less than a step more: none
    assert out.getvalue().count("\n") == 1
    clock.now += LINE_SECONDS
    lines.add(0)  # a stalled stage still says where it is
    clock.now += 1.0
    lines.add(100 - lines.done)
    lines.close()
    got = out.getvalue().splitlines()
    assert len(got) == 3, got
    assert all(line.startswith("[progress] transfer ") and "\r" not in line for line in got)
    assert got[0].startswith("[progress] transfer  11.0%, 11 B / 100 B, ") and "ETA" not in got[0]
    assert "100.0%" in got[-1] and "ETA" not in got[-1]


def test_the_mode_follows_the_rank_and_the_stream() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert resolve_mode("auto", 0, Tty()) == "bar"
    assert resolve_mode("auto", 0, io.StringIO()) == "lines"  # a launcher's pipe, a log
    assert resolve_mode("bar", 0, io.StringIO()) == "lines"  # carriage returns are noise in a file
    assert resolve_mode("lines", 0, Tty()) == "lines"
    assert resolve_mode("none", 0, Tty()) == "none"
    assert resolve_mode("auto", 1, Tty()) == "none"  # rank 0 only
    assert Progress("x", 0, "bar", stream=Tty()).mode == "none"  # nothing to count


class _Gone(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(5, "Input/output error")


def test_a_terminal_that_is_gone_ends_the_progress_not_the_copy() -> None:
    bar = Progress("bcast", 10, "bar", stream=_Gone())
    bar.add(5)  # the write fails: the progress turns itself off
    assert not bar.enabled
    bar.add(5)
    bar.close()


def _stamped(proc: subprocess.Popen[str]) -> dict[str, list[tuple[float, str]]]:
    """Every line of the process's stdout and stderr with the time it arrived."""
    got: dict[str, list[tuple[float, str]]] = {"out": [], "err": []}

    def read(name: str, stream: io.TextIOBase) -> None:
        for line in stream:
            got[name].append((time.monotonic(), line.rstrip("\n")))

    threads = [
        threading.Thread(target=read, args=(name, stream))
        for name, stream in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for t in threads:
        t.start()
    proc.wait(timeout=MPI_TIMEOUT)
    for t in threads:
        t.join()
    return got


def test_under_mpiexec_a_pipe_sees_stage_lines_as_they_end_and_status_lines_meanwhile(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    container = "progress-lines"
    azurite.upload(emulator, container, {f"p/{i}.bin": pseudo_random(6 * MiB, f"pl{i}") for i in range(4)})
    # 24 MiB at 4 MB/s: about 6 s of download, long enough for status lines on the way.
    cmd = [
        mpiexec_path(),
        "-n",
        "2",
        sys.executable,
        "-m",
        "azcp_cluster",
        emulator.url(container, "p"),
        str(tmp_path / "{rank}"),
        "--max-bandwidth",
        "4MB/s",
        "--block-size",
        "1MiB",
    ]
    proc = subprocess.Popen(
        cmd, env=clean_env(emulator.key_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    got = _stamped(proc)
    assert proc.returncode == 0, got
    out = dict((line.split(" ", 1)[0], at) for at, line in got["out"])
    assert list(out) == ["[cluster]", "[list]", "[diff]", "[download]", "[bcast]", "[total]", "azcp-cluster:"], got
    assert out["azcp-cluster:"] >= out["[total]"]  # the summary line last
    # The first three as soon as they are known, seconds before the end.
    assert out["[total]"] - out["[diff]"] > 3.0, got["out"]
    status = [(at, line) for at, line in got["err"] if line.startswith("[progress] ")]
    assert len(status) >= 3, got["err"]
    assert all(out["[diff]"] <= at <= out["[bcast]"] for at, _ in status[:-1]), (status, out)
    # The last is written when the transfer ends, milliseconds before [bcast] on the other pipe:
    # each crosses the launcher on its own, so it may be read a little later.
    assert out["[diff]"] <= status[-1][0] <= out["[bcast]"] + 0.5, (status, out)
    assert status[-1][0] - status[0][0] > 2.0  # spread over the copy, not printed at its end
    assert any(", ETA " in line for _, line in status), status  # once the rate is steady


_UNITS = {"B": 1, "KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}
_LINE = re.compile(
    r"\[progress\] transfer +(?P<pct>[\d.]+)%, (?P<done>[\d.]+) (?P<du>\w+) / (?P<total>[\d.]+) (?P<tu>\w+), "
    r"[\d.]+ \w+/s(?P<eta>, ETA \w+)?, (?P<files>\d+)/(?P<of>\d+) files$"
)


def test_under_mpiexec_every_progress_line_adds_up(emulator: azurite.Emulator, tmp_path: Path) -> None:
    # Four "nodes", a paced copy of the demo's dataset (27 files, one of them empty): each line's
    # percent is its bytes over its total, no ETA in the first 2 s, the files counted as [list] does.
    container = "progress-adds-up"
    azurite.upload(emulator, container, checkpoint_like(20 * MiB))
    cmd = [mpiexec_path(), "-n", "4", sys.executable, "-m", "azcp_cluster", emulator.url(container, "llama-tiny"),
           str(tmp_path / "node{rank}"), "--max-bandwidth", "4MB/s", "--block-size", "1MiB"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=clean_env(emulator.key_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    got = _stamped(proc)
    assert proc.returncode == 0, got
    out = {line.split(" ", 1)[0]: (at, line) for at, line in got["out"]}
    listed = int(out["[list]"][1].split()[1])
    assert listed == 27
    status = [(at, line) for at, line in got["err"] if line.startswith("[progress] ")]
    assert len(status) >= 3, got["err"]
    for at, line in status:
        m = _LINE.match(line)
        assert m, line
        done = float(m["done"]) * _UNITS[m["du"]]
        total = float(m["total"]) * _UNITS[m["tu"]]
        assert abs(float(m["pct"]) - 100 * done / total) <= 1.0, line
        assert int(m["of"]) == listed, line
        assert not m["eta"] or at - out["[diff]"][0] >= 2.0, (line, at - out["[diff]"][0])
    assert any(_LINE.match(line)["eta"] for _, line in status), status  # type: ignore[index]
    assert _LINE.match(status[-1][1])["files"] == str(listed)  # type: ignore[index]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_in_an_80_column_terminal_the_bar_is_one_line_that_ends_clean(tmp_path: Path) -> None:
    # A local SOURCE read by one rank, without a launcher: the bar draws on a real terminal.
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}.bin").write_bytes(pseudo_random(2 * MiB, f"tm{i}"))
    log = tmp_path / "screen.txt"
    socket = f"azcp-{os.getpid()}"
    tool = f"{sys.executable} -m azcp_cluster {src} {tmp_path / 'dest'} --progress bar"
    script = tmp_path / "run.sh"
    script.write_text(f"cd {os.getcwd()}\n{tool} >/dev/null\necho done-$?\nsleep 30\n")
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    env = clean_env()
    subprocess.run([*tmux, "new-session", "-d", "-x", "80", "-y", "24", "bash", str(script)], env=env, check=True)
    try:
        deadline = time.monotonic() + MPI_TIMEOUT
        screen = ""
        while time.monotonic() < deadline and "done-" not in screen:
            time.sleep(0.2)
            screen = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "0"], env=env, capture_output=True, text=True
            ).stdout
        log.write_text(screen)
    finally:
        subprocess.run([*tmux, "kill-server"], env=env, check=False)
    rows = [row for row in screen.splitlines() if row.strip()]
    assert rows[-1] == "done-0", screen
    bars = rows[:-1]
    assert len(bars) == 1, screen  # one line: redrawn in place, never wrapped or stacked
    assert bars[0].startswith("bcast ") and "100.0%" in bars[0] and "ETA" not in bars[0], screen
    assert len(bars[0]) <= 79
