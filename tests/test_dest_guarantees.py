"""What a hostile or busy machine can do to DEST and SOURCE, end to end under a real `mpiexec -n 4`.

One run per DEST (the lock), nothing written outside DEST's real path (links, FIFOs), a local
SOURCE that changes while it is read, and a ``--verify`` that reads the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.core.naming import LOCK_NAME, TEMP_SUFFIX
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.devtools.faultproxy import FaultProxy, Rule
from tests.conftest import bind_mount, clean_env, mpiexec_path, run_cli, tree_of

RANKS = 4
PROGRAMS = Path(__file__).parent / "programs"


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("azcp-cluster: error")]


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _cli(args: list[str], n: int = RANKS, env: dict[str, str] | None = None) -> list[str]:
    return [mpiexec_path(), "-n", str(n), sys.executable, "-m", "azcp_cluster", *args, "--no-progress"]


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


# ---------------------------------------------------------------------------------------
# one run per DEST


@pytest.fixture(scope="module")
def slow_blobs(emulator: azurite.Emulator) -> tuple[str, dict[str, bytes]]:
    """48 blobs of 1 MiB (48 MiB): with --max-bandwidth 16MiB/s, a download of about 3 s."""
    container = "lock" + uuid.uuid4().hex[:12]
    blobs = {f"ckpt/shard-{i:02d}.bin": pseudo_random(MiB, f"lock{i}") for i in range(48)}
    azurite.upload(emulator, container, blobs)
    return container, {k.removeprefix("ckpt/"): v for k, v in blobs.items()}


SLOW = ["--max-bandwidth", "16MiB/s", "--block-size", "256KiB"]


def _wait(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[str, str]:
    """``proc``'s output once it ends; killed if it outlives ``timeout`` (a hung run must not
    outlive its test and spin the machine's cores)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


@contextmanager
def _holding(
    emulator: azurite.Emulator, args: list[str], cmd: Callable[[list[str]], list[str]], env: dict[str, str]
) -> Iterator[subprocess.Popen[str]]:
    """A first run of ``cmd(args)``, once it holds DEST; waited for at the end.

    SOURCE (``args[0]``, the emulator's URL) is taken through a proxy that holds every ranged
    GET until the body of the ``with`` has run (60 s at the most): the first run holds DEST for
    as long as the test needs it, however slowly a loaded machine starts the second (a bandwidth
    cap alone raced the second run's start-up, which load stretches, against a fixed 3 s). Its
    first GET says it holds DEST: the downloads come after the lock, agreed by every node
    (one node's lock file alone may still be given back), and after the listing.
    """
    reached, release = threading.Event(), threading.Event()
    until = time.monotonic() + 60

    def held_until_released() -> None:
        reached.set()
        release.wait(max(0.0, until - time.monotonic()))

    hold = Rule("pass", blob="*", times=10**6, before=held_until_released)
    with FaultProxy(emulator, [hold]) as proxy:
        held = [args[0].replace(emulator.endpoint, proxy.endpoint, 1), *args[1:]]
        first = subprocess.Popen(cmd(held), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while not reached.wait(0.02) and first.poll() is None and time.monotonic() < until:
                pass
            assert reached.is_set(), f"the first run never reached its downloads (exit {first.poll()})"
            yield first
            release.set()
            _, err = _wait(first)
        finally:
            release.set()
            if first.poll() is None:  # a hung run must not outlive the test (and spin its cores)
                first.kill()
                first.communicate()
    assert first.returncode == 0, err


@pytest.mark.slow  # CI's slow step (.ci/run): the default suite stays under 10 minutes
def test_two_runs_on_one_dest_one_second_apart_both_end_with_every_copy_right(
    emulator: azurite.Emulator, slow_blobs: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    container, files = slow_blobs
    args = [emulator.url(container, "ckpt"), str(tmp_path / "d" / "{rank}"), *SLOW]
    env = clean_env(emulator.key_env())
    with _holding(emulator, args, _cli, env):
        time.sleep(1.0)
        second = subprocess.Popen(_cli(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # The first run holds DEST (its downloads held) until the second says it waits for it.
            err_lines: list[str] = []
            waits = threading.Event()

            def read_stderr() -> None:
                assert second.stderr is not None
                for line in second.stderr:
                    err_lines.append(line)
                    if "in use by another run" in line:
                        waits.set()

            reader = threading.Thread(target=read_stderr, daemon=True)
            reader.start()
            waits.wait(60)
        except BaseException:
            second.kill()
            raise
    try:
        second.wait(120)
    finally:
        if second.poll() is None:
            second.kill()
    reader.join(10)
    assert second.stdout is not None
    out2, err2 = second.stdout.read(), "".join(err_lines)
    assert second.returncode == 0, err2
    # The second waited for the first (one notice naming the holder), then found the files in place.
    notices = [line for line in err2.splitlines() if line.startswith("azcp-cluster: notice")]
    assert len(notices) == 1 and "in use by another run" in notices[0] and "pid" in notices[0], err2
    assert "0 to transfer" in out2 or "48 skipped" in out2, out2
    zeros = _md5(bytes(MiB))
    for rank in range(RANKS):
        copy = tree_of(tmp_path / "d" / str(rank))
        assert sorted(copy) == sorted(files)
        for rel, data in files.items():
            assert _md5(copy[rel]) == _md5(data) != zeros, f"rank {rank}: {rel}"
        assert not (tmp_path / "d" / str(rank) / LOCK_NAME).exists(), "the lock file goes with its run"


def test_lock_fail_exits_9_at_once_while_another_run_holds_dest(
    emulator: azurite.Emulator, slow_blobs: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    container, files = slow_blobs
    args = [emulator.url(container, "ckpt"), str(tmp_path / "d" / "{rank}"), *SLOW]
    with _holding(emulator, args, _cli, clean_env(emulator.key_env())) as first:
        started = time.monotonic()
        second = run_cli([*args, "--lock", "fail"], env=emulator.key_env(), json_path=tmp_path / "r.json")
        took = time.monotonic() - started
        assert first.poll() is None, "the first run must still hold DEST for this test to mean anything"
    assert second.returncode == 9, second.output
    (line,) = _errors(second.stderr)
    assert "[lock]" in line and "in use by another run" in line and "--lock fail" in line, line
    assert second.json is not None and second.json["exit_code"] == 9
    assert took < 15, f"--lock fail must not wait ({took:.1f} s)"
    for rank in range(RANKS):
        assert tree_of(tmp_path / "d" / str(rank)) == files


def test_lock_timeout_bounds_the_wait(
    emulator: azurite.Emulator, slow_blobs: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    container, _ = slow_blobs
    args = [emulator.url(container, "ckpt"), str(tmp_path / "d" / "{rank}"), *SLOW]
    with _holding(emulator, args, _cli, clean_env(emulator.key_env())):
        second = run_cli([*args, "--lock-timeout", "0.5"], env=emulator.key_env())
    assert second.returncode == 9, second.output
    (line,) = _errors(second.stderr)
    assert "--lock-timeout" in line, line


@pytest.mark.slow  # about 9 s: CI's slow step (.ci/run); the default suite stays under 10 minutes
def test_two_jobs_whose_nodes_overlap_in_opposite_order_both_complete(
    emulator: azurite.Emulator, slow_blobs: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    # Job A: rank 0 writes X, rank 1 writes Y. Job B: rank 0 writes Y, rank 1 writes X (through
    # links: the same real directories). A lock taken in rank order would deadlock them.
    container, files = slow_blobs
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    for job, order in (("a", ("x", "y")), ("b", ("y", "x"))):
        (tmp_path / job).mkdir()
        for rank, target in enumerate(order):
            (tmp_path / job / str(rank)).symlink_to(tmp_path / target)
    env = clean_env(emulator.key_env())
    jobs = [
        subprocess.Popen(
            _cli([emulator.url(container, "ckpt"), str(tmp_path / job / "{rank}"), *SLOW, "--compare", "none"], n=2),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job in ("a", "b")
    ]
    results = [_wait(job) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], results
    for target in ("x", "y"):
        assert tree_of(tmp_path / target) == files


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="pid namespaces need root and unshare")
def test_runs_in_separate_pid_namespaces_are_told_apart(
    emulator: azurite.Emulator, slow_blobs: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    # Two containers on one host: the same hostname and the same small pids. The second run
    # must see another run holding DEST (exit 9 with --lock fail), not its own rank (exit 2).
    container, _ = slow_blobs
    args = [emulator.url(container, "ckpt"), str(tmp_path / "d"), *SLOW]
    env = clean_env(emulator.key_env())
    # Each "container" also gets its own /dev/shm, as containers do: two MPICH jobs with the
    # same hostname and pids would otherwise meet in the same shared-memory names.
    own_shm = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
    # --kill-child: killing unshare (a test that times out) ends everything in its namespace.
    isolated = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "sh", "-c", own_shm, "sh"]
    with _holding(emulator, args, lambda held: [*isolated, *_cli(held, n=2)], env):
        second = subprocess.run(
            [*isolated, *_cli([*args, "--lock", "fail"], n=2)], env=env, capture_output=True, text=True, timeout=60
        )
    assert second.returncode == 9, second.stderr
    assert "in use by another run" in second.stderr


def test_a_dest_spelled_through_a_link_and_dot_dot_is_where_the_kernel_says(tmp_path: Path) -> None:
    files = {"a.bin": b"a"}
    _write_tree(tmp_path / "src", files)
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "link").symlink_to(tmp_path / "b" / "deep")
    result = run_cli([str(tmp_path / "src"), str(tmp_path / "a" / "link" / ".." / "x{rank}")], n=2)
    assert result.returncode == 0, result.output
    for rank in range(2):
        assert tree_of(tmp_path / "b" / f"x{rank}") == files  # "link/.." is b, as the kernel resolves it
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["link"]


# ---------------------------------------------------------------------------------------
# ranks, nodes and their DESTs on one machine


def _two_ranks(tmp_path: Path, files: dict[str, bytes]) -> tuple[Path, Path]:
    """A SOURCE of ``files`` and the base of two ranks' DESTs (``base/{rank}``)."""
    _write_tree(tmp_path / "src", files)
    (tmp_path / "d").mkdir()
    return tmp_path / "src", tmp_path / "d"


UTS = 'hostname "pod-$PMI_RANK$OMPI_COMM_WORLD_RANK" && exec "$@"'


@pytest.mark.parametrize("how", ["bind-mount", "symlink", "two-host-names"])
def test_one_directory_reached_by_two_paths_on_one_machine_is_one_node(tmp_path: Path, how: str) -> None:
    # Rank 1's DEST is rank 0's reached another way: a bind mount, a symbolic link, or two
    # containers with host names of their own mounting one host directory at different places
    # (each rank in a UTS namespace of its own). One directory on one machine: one node, one writer.
    files = {"model.bin": pseudo_random(2 * MiB + 5, "one"), "sub/config.json": b"{}"}
    source, base = _two_ranks(tmp_path, files)
    (base / "0").mkdir()
    args = [str(source), str(base / "{rank}"), "--no-progress"]
    if how == "symlink":
        (base / "1").symlink_to(base / "0")
        mounted = contextlib.nullcontext(base / "1")
    else:
        mounted = bind_mount(base / "0", base / "1")
    with mounted:
        if how == "two-host-names":
            if os.geteuid() != 0 or not shutil.which("unshare"):
                pytest.skip("UTS namespaces need root and unshare")
            cmd = [mpiexec_path(), "-n", "2", "unshare", "--uts", "sh", "-c", UTS, "sh",
                   sys.executable, "-m", "azcp_cluster", *args]  # fmt: skip
            proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
            result_code, out, err = proc.returncode, proc.stdout, proc.stderr
            cluster = "[cluster] 2 ranks on 2 hosts, 1 copy"  # two host names, one machine, one directory
        else:
            result = run_cli(args, n=2)
            result_code, out, err = result.returncode, result.stdout, result.stderr
            cluster = "[cluster] 2 ranks on 1 host, 1 copy"
        assert result_code == 0, out + err
        assert cluster in out, out
        assert tree_of(base / "0") == files


@pytest.mark.parametrize("how", ["symlink", "bind-mount"])
def test_a_dest_inside_another_nodes_dest_on_one_host_is_refused_every_time(tmp_path: Path, how: str) -> None:
    # Rank 1's DEST is a directory inside rank 0's: rank 0's copy would hold rank 1's files,
    # lock, manifest and journal, and each node's files would land among the other's.
    files = {"sub/x": b"rank 0 puts this in its sub/", "x": pseudo_random(MiB, "top")}
    source, base = _two_ranks(tmp_path, files)
    (base / "0" / "sub").mkdir(parents=True)
    if how == "symlink":
        (base / "1").symlink_to(base / "0" / "sub")
        mounted = contextlib.nullcontext(base / "1")
    else:
        mounted = bind_mount(base / "0" / "sub", base / "1")
    with mounted:
        for _ in range(2):  # and a rerun does no better
            result = run_cli([str(source), str(base / "{rank}"), "--no-progress"], n=2, timeout=60)
            assert result.returncode == 2, result.output
            (line,) = _errors(result.stderr)
            assert f"[topology]: rank 1: '{base / '1'}': DEST lies inside rank 0's DEST {base / '0'}" in line, line
            assert "Traceback" not in result.output
            assert sorted(p.relative_to(base / "0").as_posix() for p in (base / "0").rglob("*")) == ["sub"]


def test_one_dest_shared_by_two_machines_is_refused_naming_the_other_machine(tmp_path: Path) -> None:
    # DEST on a shared filesystem, seen by two machines (their boot ids differ; the host name
    # may well be the same): two nodes, one directory. Refused when their leaders meet at its lock.
    source, base = _two_ranks(tmp_path, {"a.bin": b"a"})
    boots = tmp_path / "boot"
    boots.mkdir()
    for rank in range(2):
        (boots / str(rank)).write_text(f"{uuid.uuid4()}\n")
    result = run_cli([str(source), str(base / "shared"), "--no-progress"], n=2, env={"AZCP_BOOT_IDS": str(boots)},
                     program=[str(PROGRAMS / "own_machine.py")], timeout=60)  # fmt: skip
    assert result.returncode == 2, result.output
    (line,) = _errors(result.stderr)
    assert "DEST is the same directory as the DEST of rank" in line and "on another machine (host " in line, line
    assert "a shared filesystem" in line and "{host}" in line, line
    assert not (base / "shared" / "a.bin").exists()


# ---------------------------------------------------------------------------------------
# nothing written outside DEST


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "victim.bin"
    path.parent.mkdir()
    path.write_bytes(b"must not change")
    return path


def test_a_symlink_at_a_temporary_name_is_replaced_and_nothing_outside_dest_changes(
    tmp_path: Path, victim: Path
) -> None:
    files = {"model.bin": pseudo_random(3 * MiB, "m"), "sub/tok.json": b"{}"}
    _write_tree(tmp_path / "src", files)
    for rank in range(RANKS):
        (tmp_path / "d" / str(rank) / "sub").mkdir(parents=True)
        (tmp_path / "d" / str(rank) / f".model.bin{TEMP_SUFFIX}").symlink_to(victim)
        (tmp_path / "d" / str(rank) / "sub" / f".tok.json{TEMP_SUFFIX}").symlink_to(victim)
    started = time.monotonic()
    result = run_cli([str(tmp_path / "src"), str(tmp_path / "d" / "{rank}")], timeout=30)
    assert time.monotonic() - started < 30
    assert result.returncode == 0, result.output
    assert victim.read_bytes() == b"must not change"
    for rank in range(RANKS):
        assert tree_of(tmp_path / "d" / str(rank)) == files
        assert not (tmp_path / "d" / str(rank) / "model.bin").is_symlink()


def test_a_symlinked_directory_inside_dest_is_refused_with_exit_8_naming_it(tmp_path: Path, victim: Path) -> None:
    files = {"sub/victim.bin": pseudo_random(MiB, "v"), "top.bin": b"top"}
    _write_tree(tmp_path / "src", files)
    for rank in range(RANKS):
        (tmp_path / "d" / str(rank)).mkdir(parents=True)
    (tmp_path / "d" / "2" / "sub").symlink_to(victim.parent)
    started = time.monotonic()
    result = run_cli([str(tmp_path / "src"), str(tmp_path / "d" / "{rank}")], timeout=30)
    assert time.monotonic() - started < 30
    assert result.returncode == 8, result.output
    (line,) = _errors(result.stderr)
    assert f"rank 2: '{tmp_path / 'd' / '2' / 'sub'}'" in line and "symbolic link" in line, line
    assert "Traceback" not in result.output
    assert victim.read_bytes() == b"must not change"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.bin"]
    for rank in range(RANKS):
        assert not (tmp_path / "d" / str(rank) / "top.bin").exists(), "nothing under a final name"


def test_a_fifo_at_a_temporary_name_is_removed_and_the_job_does_not_hang(tmp_path: Path) -> None:
    files = {"a.bin": pseudo_random(MiB, "a")}
    _write_tree(tmp_path / "src", files)
    for rank in range(RANKS):
        (tmp_path / "d" / str(rank)).mkdir(parents=True)
        os.mkfifo(tmp_path / "d" / str(rank) / f".a.bin{TEMP_SUFFIX}")
    result = run_cli([str(tmp_path / "src"), str(tmp_path / "d" / "{rank}")], timeout=30)
    assert result.returncode == 0, result.output
    for rank in range(RANKS):
        assert tree_of(tmp_path / "d" / str(rank)) == files


def test_json_report_inside_dest_is_refused(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", {"a.bin": b"a"})
    (tmp_path / "d" / "0").mkdir(parents=True)
    result = run_cli([str(tmp_path / "src"), str(tmp_path / "d" / "{rank}")], json_path=tmp_path / "d" / "0" / "a.bin")
    assert result.returncode == 2, result.output
    (line,) = _errors(result.stderr)
    assert "--json" in line and "inside DEST" in line, line
    assert list((tmp_path / "d" / "0").iterdir()) == []


def test_dest_inside_source_is_refused_on_every_rank(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", {"a.bin": b"a"})
    # Only rank 3's DEST lies inside SOURCE, and rank 0 reads: still refused, before any write.
    (tmp_path / "d").mkdir()
    for rank in range(RANKS):
        target = tmp_path / "src" / "inner" if rank == 3 else tmp_path / "elsewhere" / str(rank)
        if rank != 3:
            target.mkdir(parents=True)
        (tmp_path / "d" / str(rank)).symlink_to(target)
    result = run_cli([str(tmp_path / "src"), str(tmp_path / "d" / "{rank}"), "--source-rank", "0"])
    assert result.returncode == 2, result.output
    (line,) = _errors(result.stderr)
    assert "rank 3" in line and "inside SOURCE" in line, line
    assert not (tmp_path / "src" / "inner").exists()


def test_source_inside_dest_is_refused_on_every_rank(tmp_path: Path) -> None:
    # Only rank 3's DEST holds SOURCE (one file, which would land as DEST/a.bin: over itself),
    # and rank 0 reads: still refused, exit 2, before any write.
    (tmp_path / "d" / "3").mkdir(parents=True)
    (tmp_path / "d" / "3" / "a.bin").write_bytes(b"the only copy")
    result = run_cli([str(tmp_path / "d" / "3" / "a.bin"), str(tmp_path / "d" / "{rank}"), "--source-rank", "0"])
    assert result.returncode == 2, result.output
    (line,) = _errors(result.stderr)
    assert "rank 3" in line and "is inside DEST" in line, line
    assert "Traceback" not in result.output
    assert [p.name for p in (tmp_path / "d" / "3").iterdir()] == ["a.bin"]
    assert (tmp_path / "d" / "3" / "a.bin").read_bytes() == b"the only copy"


# ---------------------------------------------------------------------------------------
# a local SOURCE that changes while it is read


def _rewriter(path: Path, stop: threading.Event, started: threading.Event) -> None:
    """Rewrite bytes of ``path`` in place (no truncation, no rename) until told to stop."""
    fd = os.open(path, os.O_WRONLY)
    try:
        size = path.stat().st_size
        step = 0
        while not stop.is_set():
            os.pwrite(fd, os.urandom(4096), (step * 7919 * 4096) % (size - 4096))
            step += 1
            started.set()
            time.sleep(0.002)
    finally:
        os.close(fd)


def _when_the_broadcast_runs(dest: Path, name: str, proc: subprocess.Popen[str]) -> None:
    marker = dest / "3" / f".{name}{TEMP_SUFFIX}"
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)


def test_a_local_file_rewritten_in_place_while_it_is_read_never_ends_in_a_torn_copy(tmp_path: Path) -> None:
    data = pseudo_random(96 * MiB, "torn")
    _write_tree(tmp_path / "src", {"big.bin": data, "small.bin": b"small"})
    stop, started = threading.Event(), threading.Event()
    args = [str(tmp_path / "src"), str(tmp_path / "d" / "{rank}"), "--bcast-chunk", "1MiB", "--bcast-pipeline", "2"]
    proc = subprocess.Popen(_cli(args), env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _when_the_broadcast_runs(tmp_path / "d", "big.bin", proc)
    writer = threading.Thread(target=_rewriter, args=(tmp_path / "src" / "big.bin", stop, started))
    writer.start()
    try:
        out, err = _wait(proc)
    finally:
        stop.set()
        writer.join()
    assert started.is_set()
    # Written to all along: read once, read again, still changing: exit 5 naming the file.
    assert proc.returncode == 5, (out, err)
    (line,) = _errors(err)
    assert "[source]" in line and "changed while it was read" in line and "big.bin" in line, line
    for rank in range(RANKS):
        assert not (tmp_path / "d" / str(rank) / "big.bin").exists(), "a torn copy under its final name"


@pytest.mark.slow  # CI's slow step (.ci/run): the default suite stays under 10 minutes
def test_a_local_file_changed_once_while_it_is_read_is_read_again(tmp_path: Path) -> None:
    data = pseudo_random(64 * MiB, "once")
    _write_tree(tmp_path / "src", {"big.bin": data})
    args = [str(tmp_path / "src"), str(tmp_path / "d" / "{rank}"), "--bcast-chunk", "1MiB", "--bcast-pipeline", "2"]
    proc = subprocess.Popen(_cli(args), env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _when_the_broadcast_runs(tmp_path / "d", "big.bin", proc)
    fd = os.open(tmp_path / "src" / "big.bin", os.O_WRONLY)
    try:
        os.pwrite(fd, b"CHANGED!" * 512, 0)  # once, at the start: the first chunk went out before
    finally:
        os.close(fd)
    out, err = _wait(proc)
    assert proc.returncode == 0, (out, err)
    now = (tmp_path / "src" / "big.bin").read_bytes()
    for rank in range(RANKS):
        assert (tmp_path / "d" / str(rank) / "big.bin").read_bytes() == now, f"rank {rank}: not the file as it is"


def test_dangling_symlinks_in_a_local_source_are_skipped_with_one_warning(tmp_path: Path) -> None:
    files = {"a.bin": b"a", "sub/b.bin": b"b"}
    _write_tree(tmp_path / "src", files)
    (tmp_path / "src" / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "src" / "sub" / "gone2").symlink_to(tmp_path / "nowhere2")
    result = run_cli([str(tmp_path / "src"), str(tmp_path / "d" / "{rank}")], json_path=tmp_path / "r.json")
    assert result.returncode == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: warning")]
    assert len(warnings) == 1 and "2 dangling symbolic link" in warnings[0], result.stderr
    assert result.json is not None and result.json["filtered_out"] == 2
    for rank in range(RANKS):
        assert tree_of(tmp_path / "d" / str(rank)) == files


def test_an_unreadable_source_file_is_a_source_error(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", {"a.bin": b"a" * 5000, "b.bin": b"b"})
    # Root reads anything: deny with a FIFO swapped in after listing instead of permissions.
    program = PROGRAMS / "swap_source_for_fifo.py"
    result = run_cli([str(tmp_path / "src"), str(tmp_path / "d" / "{rank}")], program=[str(program)])
    assert result.returncode == 5, result.output
    (line,) = _errors(result.stderr)
    assert "[source]" in line and "a.bin" in line and "cannot read" in line, line


# ---------------------------------------------------------------------------------------
# --verify reads the disk


@pytest.mark.parametrize("mode", ["disk", "stream"])
def test_verify_disk_catches_a_copy_corrupted_after_it_was_written(tmp_path: Path, mode: str) -> None:
    files = {"a.bin": pseudo_random(2 * MiB, "va"), "sub/b.bin": pseudo_random(MiB + 17, "vb")}
    _write_tree(tmp_path / "src", files)
    args = [str(tmp_path / "src"), str(tmp_path / "d" / "{rank}"), "--verify" if mode == "disk" else "--verify=stream"]
    result = run_cli(
        args,
        program=[str(PROGRAMS / "corrupt_before_verify.py")],
        env={"AZCP_CORRUPT_RANK": "2", "AZCP_CORRUPT_FILE": "sub/b.bin"},
    )
    if mode == "stream":
        # The in-flight check hashes the bytes as they pass, not the disk: it cannot see this.
        assert result.returncode == 0, result.output
        return
    assert result.returncode == 7, result.output
    (line,) = _errors(result.stderr)
    assert "[verify]" in line and "rank 2" in line and "sub/b.bin" in line and "on disk" in line, line
    for rank in range(RANKS):
        assert not (tmp_path / "d" / str(rank) / "sub" / "b.bin").exists(), "renamed before the verify"


@pytest.mark.slow  # CI's slow step (.ci/run): the default suite stays under 10 minutes
def test_verify_records_the_md5_a_local_source_lacks_so_compare_md5_can_skip(tmp_path: Path) -> None:
    files = {"a.bin": pseudo_random(MiB, "ma"), "sub/b.bin": b"b"}
    _write_tree(tmp_path / "src", files)
    args = [str(tmp_path / "src"), str(tmp_path / "d" / "{rank}")]
    assert run_cli([*args, "--verify"]).returncode == 0
    rerun = run_cli([*args, "--compare", "md5"], json_path=tmp_path / "r.json")
    assert rerun.returncode == 0, rerun.output
    assert rerun.json is not None and rerun.json["skipped_files"] == len(files), rerun.output
    # A copy that no longer has that MD5 is copied again.
    (tmp_path / "d" / "1" / "a.bin").write_bytes(pseudo_random(MiB, "other"))
    again = run_cli([*args, "--compare", "md5"], json_path=tmp_path / "r2.json")
    assert again.returncode == 0 and again.json is not None and again.json["transfer_files"] == 1
    for rank in range(RANKS):
        assert tree_of(tmp_path / "d" / str(rank)) == files


@pytest.mark.parametrize("source", ["unreachable", "empty-directory"])
def test_a_failed_listing_leaves_no_dest_behind(source: str, tmp_path: Path) -> None:
    """DEST and the parents the run made go again when it fails before writing (issue 25); one
    that was there stays, and so does anything in it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    src = "http://127.0.0.1:1/acct/container/p" if source == "unreachable" else str(empty)
    code = 3
    fast = ["--max-retries", "0"] if source == "unreachable" else []  # a download option: a blob URL's only
    made = run_cli([src, str(tmp_path / "jobs" / "run1" / "{rank}"), *fast], n=2)
    assert made.returncode == code, made.output
    assert len(_errors(made.stderr)) == 1, made.stderr
    assert not (tmp_path / "jobs").exists(), list((tmp_path / "jobs").rglob("*"))
    (tmp_path / "there" / "1").mkdir(parents=True)
    (tmp_path / "there" / "1" / "old.bin").write_bytes(b"kept")
    kept = run_cli([src, str(tmp_path / "there" / "{rank}"), *fast], n=2)
    assert kept.returncode == code, kept.output
    assert (tmp_path / "there" / "1" / "old.bin").read_bytes() == b"kept"
    assert sorted(p.name for p in (tmp_path / "there").iterdir()) == ["1"]  # 0 made and removed, 1 kept
    assert sorted(p.name for p in (tmp_path / "there" / "1").iterdir()) == ["old.bin"]  # no lock file left
