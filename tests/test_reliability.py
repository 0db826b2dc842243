"""What is lost when things go wrong (nothing): full disks, a killed rank. Real filesystems, real MPI."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.core.errors import PeerStoppedError
from azcp_cluster.core.naming import JOURNAL_DIR, LOCK_NAME, MANIFEST_NAME, TEMP_SUFFIX
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import MPI_TIMEOUT, clean_env, launcher_text, mpiexec_path, run_cli, tree_of

RANKS = 4
PEER_TIMEOUT = 2  # seconds (--peer-timeout): a stopped rank is named this long after it stopped
TOOLS_OWN = (MANIFEST_NAME, LOCK_NAME)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


@contextmanager
def small_filesystem(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (made here), unmounted afterwards."""
    where.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True, timeout=30)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)


def _errors(stderr: str) -> list[str]:
    # Stripped: Open MPI's launcher may print a rank's line into its own banner, indented, or
    # right after a help message's NUL.
    lines = (line.strip() for line in launcher_text(stderr).splitlines())
    return [line for line in lines if line.startswith("azcp-cluster: error")]


def _assert_nothing_partial(base: Path, expected: dict[str, bytes]) -> None:
    """Every file under a final name anywhere below ``base`` is complete and correct."""
    for path in base.rglob("*"):
        # A killed run leaves its lock file (the kernel released the lock itself): not a copy.
        journal = JOURNAL_DIR in path.parts  # the block journal of the stopped run: not a copy
        if path.is_file() and not path.name.endswith(TEMP_SUFFIX) and path.name not in TOOLS_OWN and not journal:
            rel = path.relative_to(base).as_posix().split("/", 1)[1]
            assert path.read_bytes() == expected[rel], f"{path} stands under its final name but is not complete"


@needs_root
def test_too_little_space_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    files = {f"shard-{i}.bin": pseudo_random(2 * MiB, f"s{i}") for i in range(4)}  # 8 MiB
    _write_tree(tmp_path / "src", files)
    with small_filesystem(tmp_path / "small", "4m") as small:
        (tmp_path / "d").mkdir()
        for rank in range(RANKS):
            target = small if rank == 2 else tmp_path / "disk" / str(rank)
            target.mkdir(parents=True, exist_ok=True)
            (tmp_path / "d" / str(rank)).symlink_to(target)
        result = run_cli([str(tmp_path / "src"), str(tmp_path / "d" / "{rank}")])
        assert result.returncode == 8, result.output
        (line,) = _errors(result.stderr)
        assert f"rank 2: '{tmp_path / 'd' / '2'}'" in line, line
        assert f"{8 * MiB} bytes needed" in line and "bytes free" in line, line
        assert list(small.iterdir()) == [], "nothing may be written when the space check fails"
        assert not list((tmp_path / "disk").rglob("*.bin")), "no rank writes anything"


NO_PREALLOCATION = [str(Path(__file__).parent / "programs" / "no_preallocation.py")]


@needs_root
@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "sparse"])
def test_disk_full_after_the_space_check_exits_8_with_needed_and_free(tmp_path: Path, reserved: bool) -> None:
    # Two "nodes" (ranks 1 and 2) share one 10 MiB filesystem; each checks 7 MiB against 10 MiB
    # free and starts; the second then runs out. With reserved blocks, when it reserves them
    # (or at its check, if the first has reserved already); on a filesystem that cannot
    # reserve ("sparse"), in the middle of the copy.
    files = {f"part-{i}.bin": pseudo_random(7 * MiB // 4, f"p{i}") for i in range(4)}
    _write_tree(tmp_path / "src", files)
    with small_filesystem(tmp_path / "small", "10m") as small:
        (tmp_path / "d").mkdir()
        for rank in range(RANKS):
            target = small / str(rank) if rank in (1, 2) else tmp_path / "disk" / str(rank)
            target.mkdir(parents=True, exist_ok=True)
            (tmp_path / "d" / str(rank)).symlink_to(target)
        result = run_cli(
            [str(tmp_path / "src"), str(tmp_path / "d" / "{rank}"), "--bcast-chunk", "1MiB"],
            program=None if reserved else NO_PREALLOCATION,
        )
        assert result.returncode == 8, result.output
        (line,) = _errors(result.stderr)
        if reserved:
            assert "no space left on device" in line or "not enough space" in line, line
            assert f"{7 * MiB} bytes needed" in line and "bytes free" in line, line
        else:
            assert "no space left on device" in line and "cannot write" in line, line
            assert f"{7 * MiB} bytes needed on this node" in line and "bytes free" in line, line
        assert any(f"rank {r}: '{tmp_path / 'd' / str(r)}" in line for r in (1, 2)), line
        assert "Traceback" not in result.output
        _assert_nothing_partial(tmp_path / "d", files)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _pid_of_rank(tag: str, rank: int) -> int | None:
    """The process of ``rank`` in the run tagged ``tag`` (PMI_RANK under MPICH, OMPI_COMM_WORLD_RANK under Open MPI)."""
    tagged = f"AZCP_TEST_TAG={tag}".encode()
    ranks = {f"PMI_RANK={rank}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if tagged in environ and ranks & environ:
            return int(entry)
    return None


# The chain with a rank in its middle killed (rank 2 waits on a receive posted to it) or
# stopped (SIGSTOP: no launcher notices; its watcher's pulse does) in the default suite; the
# last rank of MPI's broadcast in CI's slow step.
@pytest.mark.parametrize(
    ("fanout", "victim", "how"),
    [
        ("chain", 1, signal.SIGKILL),
        ("chain", 2, signal.SIGSTOP),
        pytest.param("ibcast", 3, signal.SIGKILL, marks=pytest.mark.slow),
        pytest.param("ibcast", 0, signal.SIGSTOP, marks=pytest.mark.slow),
    ],
    ids=["chain-killed", "chain-stopped", "ibcast-killed", "ibcast-stopped"],
)
def test_a_rank_killed_or_stopped_during_the_broadcast_ends_the_job_and_the_rerun_finishes(
    tmp_path: Path, fanout: str, victim: int, how: signal.Signals
) -> None:
    old = {f"old/{i}.bin": pseudo_random(256 * 1024, f"o{i}") for i in range(3)}
    big = {"big.bin": pseudo_random(256 * MiB, "big")}
    files = {**old, **big}
    _write_tree(tmp_path / "src", files)
    dest = str(tmp_path / "d" / "{rank}")
    first = run_cli([str(tmp_path / "src"), dest, "--include", "old/*"])
    assert first.returncode == 0, first.output

    tag = uuid.uuid4().hex
    pid: int | None = None
    cmd = [
        mpiexec_path(), "-n", str(RANKS), sys.executable, "-m", "azcp_cluster", str(tmp_path / "src"), dest,
        "--bcast-chunk", "1MiB", "--bcast-pipeline", "2", "--no-progress", "--fanout", fanout,
        "--peer-timeout", str(PEER_TIMEOUT),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=clean_env({"AZCP_TEST_TAG": tag}), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # The broadcast starts right after the victim's temporary file for big.bin is created.
        marker = tmp_path / "d" / str(victim) / f".big.bin{TEMP_SUFFIX}"
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        pid = _pid_of_rank(tag, victim)
        assert pid is not None and proc.poll() is None, "the run ended before the broadcast could be hit"
        os.kill(pid, how)
        killed_at = time.monotonic()
        proc.wait(timeout=30)
        ended_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
        survived = False
        if pid is not None:
            # The launcher's kill of the stopped rank may land just after it exits (a loaded
            # machine): given 3 s, then a rank still there is one the job left behind.
            gone_by = time.monotonic() + 3
            while _pid_alive(pid) and time.monotonic() < gone_by:
                time.sleep(0.05)
            survived = _pid_alive(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a stopped rank the job left behind
    assert proc.returncode != 0, (out, err)
    assert ended_after < 10, ended_after  # the launcher ends the others, whatever they wait on
    if how == signal.SIGSTOP:
        # Named by the rank that watches it, with the documented code; the launcher's own lines may follow.
        assert ended_after >= PEER_TIMEOUT / 2, ended_after  # silent since its last pulse, a quarter earlier at most
        # The launcher's status: the aborting rank's 10, or (MPICH's mpiexec, when it reaps the
        # stopped rank it killed first) that rank's SIGKILL, 9: both documented.
        assert proc.returncode in (PeerStoppedError.exit_code, signal.SIGKILL), (proc.returncode, err)
        named = [line for line in _errors(err.decode()) if "[peer]" in line]
        assert len(named) == 1 and f"rank {victim}:" in named[0], err.decode()
        assert not survived, "the stopped rank outlived the job"
    _assert_nothing_partial(tmp_path / "d", files)
    assert not any((tmp_path / "d" / str(r) / "big.bin").exists() for r in range(RANKS))

    rerun = run_cli([str(tmp_path / "src"), dest, "--bcast-chunk", "4MiB"], json_path=tmp_path / "r.json")
    assert rerun.returncode == 0, rerun.output
    assert rerun.json is not None
    assert rerun.json["skipped_files"] == len(old) and rerun.json["broadcast_bytes"] == len(big["big.bin"])
    for rank in range(RANKS):
        assert tree_of(tmp_path / "d" / str(rank)) == files
    assert MPI_TIMEOUT > 30


@pytest.mark.parametrize("launcher", ["mpiexec", "none"])
def test_a_reader_that_goes_away_does_not_fail_a_finished_copy(tmp_path: Path, launcher: str) -> None:
    # `azcp-cluster ... | head -1` in a job script: the pipe closes after the first report line,
    # printed as soon as the cluster is known. Without a launcher the run goes on, exits 0 and
    # leaves no lock file behind. Under mpiexec the launcher dies at its next write to the pipe
    # (docs/usage.md): whatever it took with it, a rerun completes the copy.
    files = {"a.bin": pseudo_random(3 * MiB, "pipe-a"), "d/b.txt": b"b" * 100}
    _write_tree(tmp_path / "src", files)
    dest = str(tmp_path / "d" / "{rank}")
    tool = [sys.executable, "-m", "azcp_cluster", str(tmp_path / "src"), dest, "--no-progress"]
    cmd = [mpiexec_path(), "-n", "2", *tool] if launcher == "mpiexec" else tool
    script = 'set -o pipefail; "$@" | head -1'
    proc = subprocess.run(["bash", "-c", script, "pipe", *cmd], env=clean_env(), capture_output=True, text=True,
                          timeout=MPI_TIMEOUT)  # fmt: skip
    assert proc.stdout.startswith("[cluster] ") and proc.stdout.count("\n") == 1, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    if launcher == "mpiexec":
        # Mostly not 0: hydra aborts on the closed pipe (unless head was still reading).
        rerun = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=MPI_TIMEOUT)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "error" not in proc.stderr, proc.stderr
    for rank in range(2 if launcher == "mpiexec" else 1):
        copy = tmp_path / "d" / str(rank)
        assert tree_of(copy) == files, f"rank {rank}"
        assert not (copy / LOCK_NAME).exists(), "the lock file outlived the run"
