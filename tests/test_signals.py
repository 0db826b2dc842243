"""SIGINT and SIGTERM end every rank promptly, with 130 / 143, one line, the JSON report, nothing partial.

What MPICH's hydra ``mpiexec`` (the ``mpich`` wheel, 5.0) does with signals, found with a
four-rank mpi4py script that records what it receives and exits with a chosen code:

* SIGINT to ``mpiexec`` is passed on to every rank ("[mpiexec@host] Sending Ctrl-C to
  processes as requested"); a second SIGINT makes ``mpiexec`` kill everything itself (its
  "Press Ctrl-C again to force abort"; exit 255), so only the first one is ours to handle.
* SIGTERM to ``mpiexec`` is passed on to every rank, every time it comes.
* Each rank runs in a process group of its own, so a terminal's Ctrl-C reaches the ranks
  only through ``mpiexec`` (under ``srun`` a task can get it directly as well).
* ``mpiexec`` exits with the bitwise OR of the ranks' exit codes (0|130 = 130,
  1|130 = 131, 130|131|132|133 = 135): the ranks must agree on one code, or the job's
  status is a number nobody documented. A rank killed by the signal (no handler) makes
  ``mpiexec`` report it as "BAD TERMINATION" and exit with the signal number (15).

So the tests send SIGINT to ``mpiexec`` (a person's Ctrl-C), SIGTERM to every rank's own
pid (Slurm at a time limit, Kubernetes), and expect ``mpiexec``'s own status to be 130 / 143.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from azcp_cluster import cli
from azcp_cluster.core.config import MiB
from azcp_cluster.core.errors import SigintError, SigtermError
from azcp_cluster.core.naming import TEMP_SUFFIX
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.run.interrupts import Interrupts
from azcp_cluster.run.mpi import MpiRuntime
from tests.conftest import clean_env, mpiexec_path, run_cli, tree_of
from tests.test_reliability import _assert_nothing_partial, _errors, _pid_of_rank, _write_tree

RANKS = 4
# Each run must end this soon after the signal (the broadcast alone lasts longer).
PROMPT = 30.0


# -- in process: the recorder itself ---------------------------------------------------------


def _raise_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # the handler runs in the main thread at the next bytecode


def test_the_first_signal_is_recorded_and_later_ones_are_ignored() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    interrupts = Interrupts()
    with interrupts.installed():
        assert interrupts.error(3) is None
        _raise_sigterm()
        os.kill(os.getpid(), signal.SIGINT)  # a second signal: recorded, not a KeyboardInterrupt
        time.sleep(0.01)
        error = interrupts.error(3)
        assert isinstance(error, SigtermError) and error.exit_code == 143
        assert interrupts.received == 2
        assert error.one_line() == (
            "azcp-cluster: error [interrupted]: rank 3: stopped by SIGTERM; files not yet complete stay "
            "under their temporary names, a rerun finishes the copy"
        )
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_sigint_maps_to_130() -> None:
    interrupts = Interrupts()
    with interrupts.installed():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
    error = interrupts.error(0)
    assert isinstance(error, SigintError) and error.exit_code == 130 and "SIGINT" in error.one_line()


def test_abandonable_sections_raise_at_once_and_only_there() -> None:
    interrupts = Interrupts()
    with interrupts.installed():
        reached = False
        with pytest.raises(SigtermError) as caught, interrupts.abandonable(rank=1):
            _raise_sigterm()
            reached = True
        assert not reached and caught.value.rank == 1
        _raise_sigterm()  # outside any section: recorded (already), never raised
        # A section entered after the signal stops before it starts.
        with pytest.raises(SigtermError), interrupts.abandonable(rank=1):
            pytest.fail("the section must not run once a signal was received")


def test_an_uninstalled_recorder_never_fires() -> None:
    interrupts = Interrupts()
    with interrupts.abandonable(rank=0):
        pass
    assert interrupts.error(0) is None and interrupts.received == 0


def test_a_keyboard_interrupt_before_mpi_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def interrupted(self: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(MpiRuntime, "comm", interrupted)
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main([str(tmp_path), str(tmp_path / "d")]) == 130
    err = capsys.readouterr().err
    assert _errors(err) == [
        "azcp-cluster: error [interrupted]: stopped by SIGINT; files not yet complete stay under their "
        "temporary names, a rerun finishes the copy"
    ], err
    assert "Traceback" not in err


HOST_PROGRAM = """
import signal, sys
import azcp_cluster

got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
mine = signal.getsignal(signal.SIGTERM)
# As the host left it: Python's default, or ignored where this process was started with SIGINT
# ignored (a parent that ignores it passes that on; the test suite's process may, once MPI ran in it).
interrupt = signal.getsignal(signal.SIGINT)
azcp_cluster.stage(sys.argv[1], sys.argv[2], quiet=True)
assert signal.getsignal(signal.SIGTERM) is mine, "stage() replaced the host's SIGTERM handler"
assert signal.getsignal(signal.SIGINT) is interrupt, "stage() replaced the SIGINT handler"
signal.raise_signal(signal.SIGTERM)
assert got == [signal.SIGTERM]
print("host handlers kept")
"""


def test_the_python_api_leaves_the_host_programs_handlers_alone(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", {"a.bin": b"a" * 5000})
    proc = subprocess.run([sys.executable, "-c", HOST_PROGRAM, str(tmp_path / "src"), str(tmp_path / "d")],
                          env=clean_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "host handlers kept" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "d" / "a.bin").read_bytes() == b"a" * 5000


# -- real mpiexec: a signal in the middle of a stage -------------------------------------------


def _has_bytes(path: Path, offset: int = 0) -> bool:
    """Whether the 4 KiB of ``path`` at ``offset`` were written (a temporary file is made all zeros)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return any(fh.read(4096))
    except OSError:
        return False


def _interrupt(
    cmd: list[str], env: dict[str, str], markers: list[Path], deliver: Callable[[subprocess.Popen[str], str], None]
) -> tuple[int, str, str, float]:
    """Start ``cmd``, ``deliver`` once bytes land in a ``marker``; return (status, stdout, stderr, seconds after).

    The temporary files are made (all zeros) before the download and the broadcast: the
    first bytes written to one show that the stage is under way.
    """
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, env=clean_env({**env, "AZCP_TEST_TAG": tag}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(map(_has_bytes, markers)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None, "the run ended before the stage could be interrupted"
        assert any(map(_has_bytes, markers)), "the stage did not start in time"
        deliver(proc, tag)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=PROMPT + 30)
        after = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err, after


def _to_mpiexec(sig: int) -> Callable[[subprocess.Popen[str], str], None]:
    def deliver(proc: subprocess.Popen[str], tag: str) -> None:
        proc.send_signal(sig)

    return deliver


def _to_every_rank(sig: int, delay: float = 0.0) -> Callable[[subprocess.Popen[str], str], None]:
    def deliver(proc: subprocess.Popen[str], tag: str) -> None:
        pids = [_pid_of_rank(tag, rank) for rank in range(RANKS)]
        assert None not in pids, pids
        time.sleep(delay)
        for pid in pids:
            assert pid is not None
            os.kill(pid, sig)

    return deliver


def _check_interrupted(status: int, out: str, err: str, after: float, report: Path, name: str, code: int) -> None:
    print(f"{name}: exit {status}, {after:.2f} s after the signal")
    assert status == code, (status, out, err)
    assert after < PROMPT, f"the job took {after:.1f} s to end after {name}"
    (line,) = _errors(err)
    assert line.startswith("azcp-cluster: error [interrupted]: rank ") and f"stopped by {name}" in line, line
    assert "temporary names" in line and "rerun" in line, line
    assert "Traceback" not in out + err, err
    doc = json.loads(report.read_text())
    assert doc["exit_code"] == code and doc["error"] == line


BIG = 256 * MiB
SLOW_BCAST = ["--bcast-chunk", "1MiB", "--bcast-pipeline", "2", "--no-progress"]


@pytest.fixture(scope="module")
def big_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    src = tmp_path_factory.mktemp("signals") / "src"
    files = {"small/a.txt": b"a" * 1000, "big.bin": pseudo_random(BIG, "signals")}
    _write_tree(src, files)
    return src, files


@pytest.mark.parametrize(
    ("name", "code", "deliver"),
    [
        ("SIGINT", 130, _to_mpiexec(signal.SIGINT)),  # a person's Ctrl-C, passed on by mpiexec
        # Slurm at a time limit: every task (in CI's slow step)
        pytest.param("SIGTERM", 143, _to_every_rank(signal.SIGTERM), marks=pytest.mark.slow),
    ],
    ids=["sigint-to-mpiexec", "sigterm-to-every-rank"],
)
def test_a_signal_during_the_broadcast_stops_every_rank_and_the_rerun_finishes(
    tmp_path: Path,
    big_source: tuple[Path, dict[str, bytes]],
    name: str,
    code: int,
    deliver: Callable[[subprocess.Popen[str], str], None],
) -> None:
    src, files = big_source
    dest = str(tmp_path / "d" / "{rank}")
    report = tmp_path / "report.json"
    cmd = [mpiexec_path(), "-n", str(RANKS), sys.executable, "-m", "azcp_cluster", str(src), dest, *SLOW_BCAST,
           "--json", str(report)]  # fmt: skip
    # Rank 0 reads SOURCE; its first chunk in rank 3's temporary file: the broadcast is under way.
    marker = tmp_path / "d" / "3" / f".big.bin{TEMP_SUFFIX}"
    status, out, err, after = _interrupt(cmd, {}, [marker], deliver)
    _check_interrupted(status, out, err, after, report, name, code)
    assert not _has_bytes(marker, BIG - 4096), "the broadcast was not stopped in the middle"
    _assert_nothing_partial(tmp_path / "d", files)
    assert not any((tmp_path / "d" / str(r) / "big.bin").exists() for r in range(RANKS))

    rerun = run_cli([str(src), dest, "--no-progress"])
    assert rerun.returncode == 0, rerun.output
    for rank in range(RANKS):
        assert tree_of(tmp_path / "d" / str(rank)) == files


@pytest.mark.slow  # CI's slow step (.ci/run): the default suite stays under 10 minutes
def test_sigterm_during_the_download_stops_every_rank_and_the_rerun_finishes(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    container = "sig" + uuid.uuid4().hex[:16]
    files = {f"part-{i}.bin": pseudo_random(16 * MiB, f"d{i}") for i in range(4)}
    azurite.upload(emulator, container, files)
    dest = str(tmp_path / "d" / "{rank}")
    report = tmp_path / "report.json"
    # 64 MiB at 16 MiB/s: the download lasts about four seconds.
    slow = ["--max-bandwidth", "16MiB/s", "--block-size", "1MiB", "--no-progress", "--json", str(report)]
    cmd = [mpiexec_path(), "-n", str(RANKS), sys.executable, "-m", "azcp_cluster", emulator.url(container), dest, *slow]
    # Each rank downloads its parts into its own DEST: rank 3's first bytes, the download is under way.
    markers = [tmp_path / "d" / "3" / f".{name}{TEMP_SUFFIX}" for name in files]
    status, out, err, after = _interrupt(cmd, emulator.key_env(), markers, _to_every_rank(signal.SIGTERM, delay=0.5))
    _check_interrupted(status, out, err, after, report, "SIGTERM", 143)
    doc = json.loads(report.read_text())
    assert doc["downloaded_bytes"] < sum(map(len, files.values())), "stopped in the download"
    assert doc["stages"]["download"]["seconds"] > 0, "the figures reached so far"
    assert doc["peak_rss_bytes"] > 16 * MiB, "every rank's peak memory, a stopped run's too"
    _assert_nothing_partial(tmp_path / "d", files)

    rerun = run_cli([emulator.url(container), dest, "--no-progress"], env=emulator.key_env())
    assert rerun.returncode == 0, rerun.output
    for rank in range(RANKS):
        assert tree_of(tmp_path / "d" / str(rank)) == files


def test_sigterm_to_a_waiting_rank_stops_the_one_still_downloading(emulator: azurite.Emulator, tmp_path: Path) -> None:
    # Kubernetes stopping one pod: the rank that got the signal has nothing to download and
    # waits at the agreement; it sends the failure signal, so the downloader stops at its next
    # poll instead of finishing a download that takes 16 s.
    container = "sig" + uuid.uuid4().hex[:16]
    files = {f"part-{i}.bin": pseudo_random(16 * MiB, f"w{i}") for i in range(4)}
    azurite.upload(emulator, container, files)
    dest = str(tmp_path / "d" / "{rank}")
    report = tmp_path / "report.json"
    slow = ["--download-ranks", "1", "--max-bandwidth", "4MiB/s", "--block-size", "1MiB", "--no-progress"]
    cmd = [mpiexec_path(), "-n", str(RANKS), sys.executable, "-m", "azcp_cluster", emulator.url(container), dest, *slow,
           "--json", str(report)]  # fmt: skip
    markers = [tmp_path / "d" / str(r) / f".{name}{TEMP_SUFFIX}" for r in range(RANKS) for name in files]
    waiting: list[int] = []

    def to_a_waiting_rank(proc: subprocess.Popen[str], tag: str) -> None:
        downloader = next(int(m.parent.name) for m in markers if _has_bytes(m))
        waiting.append((downloader + 1) % RANKS)
        pid = _pid_of_rank(tag, waiting[0])
        assert pid is not None
        os.kill(pid, signal.SIGTERM)

    status, out, err, after = _interrupt(cmd, emulator.key_env(), markers, to_a_waiting_rank)
    _check_interrupted(status, out, err, after, report, "SIGTERM", 143)
    assert after < 8, f"the downloader went on for {after:.1f} s"
    assert f"rank {waiting[0]}: stopped by SIGTERM" in _errors(err)[0]
    _assert_nothing_partial(tmp_path / "d", files)
