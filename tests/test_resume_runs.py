"""A stopped copy resumes by block: real runs (Azurite, ``mpiexec -n 2``, two DESTs as two nodes),
stopped with SIGKILL or SIGTERM once every node's journal holds about half the bytes, then rerun."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from azcp_cluster.core import resume
from azcp_cluster.core.config import MiB
from azcp_cluster.core.naming import JOURNAL_DIR, LOCK_NAME, TEMP_SUFFIX
from azcp_cluster.dest import localsource
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import clean_env, mpiexec_path, run_cli, tree_of
from tests.test_reliability import _assert_nothing_partial, _pid_of_rank

RANKS = 2  # two DESTs: two nodes


def journal_claims(dest: Path) -> dict[str, int]:
    """Per file, the bytes the journals of one node claim (merged; what a rerun could keep at most)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    try:
        names = os.listdir(dest / JOURNAL_DIR)
    except OSError:
        return {}
    for name in names:
        try:
            records, _ = resume.decode((dest / JOURNAL_DIR / name).read_bytes())
        except OSError:
            continue
        paths = {}
        for record in records:
            if isinstance(record, resume.Header):
                paths[record.id] = record.path
            elif isinstance(record, resume.Range) and record.id in paths:
                spans.setdefault(paths[record.id], []).append((record.offset, record.offset + record.length))
    return {path: resume.total(resume.merge(s)) for path, s in spans.items()}


def journal_bytes(dest: Path) -> int:
    """Bytes the journals of one node claim."""
    return sum(journal_claims(dest).values())


def stop_halfway(cmd: list[str], env: dict[str, str], dests: list[Path], total: int, sig: int,
                 share: float = 0.5, ranks: int = RANKS) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run ``cmd``; once every node's journal claims ``share`` of ``total``, send ``sig`` to every rank."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, env=clean_env({**env, "AZCP_TEST_TAG": tag}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        pids: list[int | None] = [None] * ranks
        while None in pids and proc.poll() is None and time.monotonic() < deadline:
            pids = [_pid_of_rank(tag, rank) for rank in range(ranks)]  # found before the copy runs far
        while proc.poll() is None and time.monotonic() < deadline:
            if all(journal_bytes(d) >= share * total for d in dests):
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be stopped: " + proc.communicate()[1]
        assert None not in pids, pids
        for pid in pids:
            assert pid is not None
            with contextlib.suppress(ProcessLookupError):  # (ended just now: the caller sees exit 0)
                os.kill(pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _assert_copies(base: Path, files: dict[str, bytes]) -> None:
    for rank in range(RANKS):
        copy = tree_of(base / str(rank))
        assert sorted(copy) == sorted(files), f"node {rank}: {sorted(copy)}"
        for rel, data in files.items():
            assert _md5(copy[rel]) == _md5(data), f"node {rank}: {rel} differs from its blob"
        assert not (base / str(rank) / JOURNAL_DIR).exists(), "a finished copy leaves no journal"


def _cmd(url: str, dest: str, *extra: str, n: int = RANKS) -> list[str]:
    return [mpiexec_path(), "-n", str(n), sys.executable, "-m", "azcp_cluster", url, dest, "--no-progress", *extra]


# -- the acceptance run: 1 GiB in 4 files, about 10 s, stopped halfway -------------------------


@pytest.fixture(scope="module")
def gib(emulator: azurite.Emulator) -> Iterator[tuple[str, dict[str, bytes]]]:
    container = "resume" + uuid.uuid4().hex[:12]
    files = {f"ckpt/part-{i}.bin": pseudo_random(256 * MiB, f"resume{i}") for i in range(4)}
    azurite.upload(emulator, container, files)
    yield container, files
    azurite.container_client(emulator, container, create=False).delete_container()


@pytest.mark.parametrize(
    "sig",
    # 1 GiB stopped halfway (about 35 s each): both in the slow tier, which CI runs
    # (scripts/test-slow); the default suite keeps within its 10 minutes with the smaller
    # stopped copies below (SIGKILL at 40 %).
    [pytest.param(signal.SIGKILL, marks=pytest.mark.slow), pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
    ids=["sigkill", "sigterm"],
)
def test_a_run_stopped_halfway_moves_only_what_is_missing(
    emulator: azurite.Emulator, gib: tuple[str, dict[str, bytes]], tmp_path: Path, sig: int
) -> None:
    container, files = gib
    total = sum(map(len, files.values()))
    url, dest = emulator.url(container), str(tmp_path / "d" / "{rank}")
    dests = [tmp_path / "d" / str(r) for r in range(RANKS)]
    first = stop_halfway(_cmd(url, dest, "--max-bandwidth", "100MiB/s"), emulator.key_env(), dests, total, sig)
    assert first.returncode == (143 if sig == signal.SIGTERM else first.returncode), first.stderr
    assert first.returncode != 0, "the first run must have been stopped"
    _assert_nothing_partial(tmp_path / "d", files)
    held = [journal_bytes(d) for d in dests]

    rerun = run_cli([url, dest, "--no-progress"], n=RANKS, env=emulator.key_env(), json_path=tmp_path / "r.json")
    assert rerun.returncode == 0, rerun.output
    doc = rerun.json
    assert doc is not None
    moved = doc["downloaded_bytes"] / total, doc["broadcast_bytes"] / total
    print(f"{signal.Signals(sig).name}: journals held {[h / total for h in held]}; the rerun downloaded "
          f"{moved[0]:.3f} and broadcast {moved[1]:.3f} of the bytes")  # fmt: skip
    assert moved[0] <= 0.6 and moved[1] <= 0.6, moved
    assert doc["resumed_files"] >= 1 and doc["resumed_bytes"] >= 0.9 * sum(held), doc
    # Every kept block is read back and checked against its CRC (the diff stage) before it is
    # trusted: that must cost less than downloading what it keeps, at the rerun's own rate.
    stages = doc["stages"]
    rate = doc["downloaded_bytes"] / stages["download"]["seconds"]
    kept_per_node = doc["resumed_bytes"] / RANKS  # the nodes read theirs back at once
    print(f"the kept blocks checked in {stages['diff']['seconds']:.3f} s (the diff stage); downloading "
          f"them at the rerun's {rate / 2**20:.0f} MiB/s would take {kept_per_node / rate:.3f} s")  # fmt: skip
    assert stages["diff"]["seconds"] < kept_per_node / rate, stages
    (diff,) = [line for line in rerun.stdout.splitlines() if line.startswith("[diff]")]
    assert f"{doc['resumed_files']} resumed ({doc['resumed_bytes']} bytes kept)" in diff, diff
    _assert_copies(tmp_path / "d", files)


# -- invalidation: a replaced blob, a spoiled journal, a temporary file swapped ----------------

SMALL = ["--max-bandwidth", "4MiB/s", "--block-size", "256KiB", "--bcast-chunk", "1MiB"]
SMALL_SIZE = 4 * MiB  # four of them: about four seconds at 4 MiB/s (time to stop it on a busy machine)


@pytest.fixture()
def stopped(emulator: azurite.Emulator, tmp_path: Path) -> tuple[str, dict[str, bytes], Path]:
    """4 x 4 MiB, stopped with SIGKILL once each node's journal holds 40 % of them."""
    container = "resume" + uuid.uuid4().hex[:12]
    files = {f"part-{i}.bin": pseudo_random(SMALL_SIZE, f"small{i}{container}") for i in range(4)}
    azurite.upload(emulator, container, files)
    base = tmp_path / "d"
    first = stop_halfway(_cmd(emulator.url(container), str(base / "{rank}"), *SMALL), emulator.key_env(),
                         [base / str(r) for r in range(RANKS)], 4 * SMALL_SIZE, signal.SIGKILL, share=0.4)  # fmt: skip
    assert first.returncode != 0
    return container, files, base


def _rerun(emulator: azurite.Emulator, container: str, base: Path, *extra: str) -> tuple[dict, str, str]:  # type: ignore[type-arg]
    json_path = base.parent / f"r{uuid.uuid4().hex[:6]}.json"
    rerun = run_cli([emulator.url(container), str(base / "{rank}"), "--no-progress", *extra], n=RANKS,
                    env=emulator.key_env(), json_path=json_path)  # fmt: skip
    assert rerun.returncode == 0, rerun.output
    assert rerun.json is not None
    return rerun.json, rerun.stdout, rerun.stderr


def test_a_blob_replaced_between_the_runs_is_copied_whole_from_its_new_version(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    kept_before = journal_bytes(base / "0")
    assert kept_before > 0
    new = {name: pseudo_random(len(data), "new" + name) for name, data in files.items()}  # same sizes
    azurite.upload(emulator, container, new)
    doc, _, _ = _rerun(emulator, container, base)
    assert doc["resumed_files"] == 0 and doc["resumed_bytes"] == 0, "a block of the old version was kept"
    assert doc["downloaded_bytes"] == 4 * SMALL_SIZE
    _assert_copies(base, new)


def test_one_replaced_blob_loses_its_blocks_and_the_others_keep_theirs(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    held = {name for r in range(RANKS) for name in journal_claims(base / str(r))}
    assert held, "the first run journalled nothing"
    victim = sorted(held)[0]
    files = {**files, victim: pseudo_random(len(files[victim]), "replaced")}
    azurite.upload(emulator, container, {victim: files[victim]})
    doc, _, _ = _rerun(emulator, container, base)
    assert doc["resumed_files"] == len(held) - 1
    _assert_copies(base, files)


# A truncated journal in CI's slow step; a garbled one in the default suite.
@pytest.mark.parametrize("spoil", [pytest.param("truncated", marks=pytest.mark.slow), "garbage"])
def test_a_spoiled_journal_still_gives_a_byte_identical_copy(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path], spoil: str
) -> None:
    container, files, base = stopped
    rng = random.Random(spoil)
    for rank in range(RANKS):
        for journal in (base / str(rank) / JOURNAL_DIR).iterdir():
            data = journal.read_bytes()
            if spoil == "truncated":
                journal.write_bytes(data[: rng.randrange(len(data) + 1)])
            else:
                journal.write_bytes(rng.randbytes(len(data)))
    doc, _, err = _rerun(emulator, container, base)
    warnings = [line for line in err.splitlines() if "block journal" in line]
    if spoil == "garbage":
        assert doc["resumed_files"] == 0
        assert len(warnings) == RANKS and all("cannot be read" in w for w in warnings), err
    else:
        assert not warnings, err  # a torn tail is what a kill leaves: not worth a warning
    _assert_copies(base, files)


def test_a_temporary_file_swapped_for_another_is_not_resumed(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    claims = [journal_claims(base / str(r)) for r in range(RANKS)]
    assert claims[1], "node 1 journalled nothing"
    for name in claims[1]:
        # Someone puts a file of their own (same size, other bytes) where the journal points.
        temp = base / "1" / f".{name}{TEMP_SUFFIX}"
        temp.unlink()
        temp.write_bytes(b"\xee" * len(files[name]))
    doc, _, _ = _rerun(emulator, container, base)
    assert doc["resumed_bytes"] <= sum(claims[0].values()), "node 1 kept blocks of a file it did not make"
    _assert_copies(base, files)


def test_a_journal_others_may_write_is_ignored_with_one_warning(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    os.chmod(base / "0" / JOURNAL_DIR, 0o777)
    _, _, err = _rerun(emulator, container, base)
    warnings = [line for line in err.splitlines() if "block journal" in line]
    assert len(warnings) == 1 and "only it may write" in warnings[0], err
    _assert_copies(base, files)


def test_no_resume_removes_the_journal_and_moves_every_byte(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    doc, out, _ = _rerun(emulator, container, base, "--no-resume")
    assert doc["resumed_files"] == 0 and doc["downloaded_bytes"] == 4 * SMALL_SIZE
    assert "resumed" not in out
    _assert_copies(base, files)


def test_a_resumed_copy_verifies_and_a_run_refused_by_the_lock_leaves_the_journal_alone(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    journals = {p: p.read_bytes() for r in range(RANKS) for p in (base / str(r) / JOURNAL_DIR).iterdir()}
    # Another run holds node 1's DEST: this one is refused at once (exit 9), touching nothing.
    fd = os.open(base / "1" / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        refused = run_cli([emulator.url(container), str(base / "{rank}"), "--no-progress", "--lock", "fail"],
                          n=RANKS, env=emulator.key_env())  # fmt: skip
    finally:
        os.close(fd)
    assert refused.returncode == 9, refused.output
    assert {p: p.read_bytes() for p in journals} == journals, "a refused run changed a journal"
    doc, out, _ = _rerun(emulator, container, base, "--verify")
    assert doc["resumed_files"] >= 1 and doc["verified_files"] == len(files)
    assert any(line.startswith("[verify]") and "all copies match" in line for line in out.splitlines()), out
    _assert_copies(base, files)


@pytest.mark.slow  # CI's slow step (.ci/run): the default suite stays under 10 minutes
def test_a_second_stop_keeps_what_both_runs_wrote(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    first = [journal_bytes(base / str(r)) for r in range(RANKS)]
    # The rerun is stopped too, later: its journal starts from what the first run kept.
    again = stop_halfway(_cmd(emulator.url(container), str(base / "{rank}"), *SMALL), emulator.key_env(),
                         [base / str(r) for r in range(RANKS)], 4 * SMALL_SIZE, signal.SIGKILL, share=0.7)  # fmt: skip
    assert again.returncode != 0
    second = [journal_bytes(base / str(r)) for r in range(RANKS)]
    assert all(b >= 0.7 * 4 * SMALL_SIZE and b >= a for a, b in zip(first, second, strict=True)), (first, second)
    doc, _, _ = _rerun(emulator, container, base)
    assert doc["downloaded_bytes"] <= 0.3 * 4 * SMALL_SIZE + MiB, doc["downloaded_bytes"]
    _assert_copies(base, files)


def test_the_report_counts_the_kept_bytes_over_the_nodes(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    claims = [journal_claims(base / str(r)) for r in range(RANKS)]
    held = sum(sum(c.values()) for c in claims)
    doc, _, _ = _rerun(emulator, container, base)
    assert 0.9 * held <= doc["resumed_bytes"] <= held
    assert doc["resumed_files"] == len(set(claims[0]) | set(claims[1]))
    assert doc["downloaded_bytes"] <= 4 * SMALL_SIZE - max(sum(c.values()) for c in claims) + MiB
    _assert_copies(base, files)


@pytest.mark.slow  # CI's slow step (.ci/run): the default suite stays under 10 minutes
def test_a_copy_that_fails_verify_is_not_resumed_from_again(
    emulator: azurite.Emulator, stopped: tuple[str, dict[str, bytes], Path]
) -> None:
    container, files, base = stopped
    name = sorted(journal_claims(base / "1"))[0]  # a file node 1 kept: its copy is flipped before --verify
    program = [str(Path(__file__).parent / "programs" / "corrupt_before_verify.py")]
    env = {**emulator.key_env(), "AZCP_CORRUPT_RANK": "1", "AZCP_CORRUPT_FILE": name}
    failed = run_cli([emulator.url(container), str(base / "{rank}"), "--no-progress", "--verify"], n=RANKS,
                     env=env, program=program)  # fmt: skip
    assert failed.returncode == 7, failed.output
    assert not any((base / str(r) / JOURNAL_DIR).exists() for r in range(RANKS)), "the journal outlived a mismatch"
    doc, _, _ = _rerun(emulator, container, base, "--verify")
    assert doc["resumed_files"] == 0 and doc["downloaded_bytes"] == 4 * SMALL_SIZE
    _assert_copies(base, files)


def _first_claim(dest: Path) -> tuple[str, int, int]:
    """A range node ``dest``'s journals claim: (path, offset, length)."""
    for name in sorted(os.listdir(dest / JOURNAL_DIR)):
        records, _ = resume.decode((dest / JOURNAL_DIR / name).read_bytes())
        paths = {r.id: r.path for r in records if isinstance(r, resume.Header)}
        for record in records:
            if isinstance(record, resume.Range) and record.id in paths and record.length > 4096:
                return paths[record.id], record.offset, record.length
    raise AssertionError(f"{dest}: no range claimed")


# Issue 38, case 1: a kept block whose bytes changed on one node's disk between the runs was
# trusted, sent to the other nodes and "verified" (a resumed file had no in-flight hash, and
# without a Content-MD5 the copies were only compared with each other). With and without a
# Content-MD5, on one node and on two; two of the four in CI's slow step.
@pytest.mark.parametrize(
    ("md5", "ranks"),
    [
        (False, 2),
        (True, 1),
        pytest.param(False, 1, marks=pytest.mark.slow),
        pytest.param(True, 2, marks=pytest.mark.slow),
    ],
)
def test_a_kept_block_changed_on_disk_is_fetched_again_not_spread(
    emulator: azurite.Emulator, tmp_path: Path, md5: bool, ranks: int
) -> None:
    from azure.storage.blob import ContentSettings

    container = "resume" + uuid.uuid4().hex[:12]
    files = {f"part-{i}.bin": pseudo_random(SMALL_SIZE, f"flip{i}{container}") for i in range(4)}
    azurite.upload(emulator, container, files)
    client = azurite.container_client(emulator, container, create=False)
    if not md5:  # as block uploads leave large checkpoints: no Content-MD5 to check against
        for name in files:
            client.get_blob_client(name).set_http_headers(ContentSettings(content_type="application/octet-stream"))
    assert all(bool(b.content_settings.content_md5) == md5 for b in client.list_blobs())
    base = tmp_path / "d"
    dests = [base / str(r) for r in range(ranks)]
    first = stop_halfway(_cmd(emulator.url(container), str(base / "{rank}"), *SMALL, n=ranks), emulator.key_env(),
                         dests, 4 * SMALL_SIZE, signal.SIGKILL, share=0.4, ranks=ranks)  # fmt: skip
    assert first.returncode != 0
    claimed = sum(journal_bytes(d) for d in dests)
    name, offset, _ = _first_claim(dests[0])
    head, _, tail = name.rpartition("/")
    temp = dests[0] / head / f".{tail}{TEMP_SUFFIX}"
    with open(temp, "r+b") as fh:  # one byte of a kept block flipped on node 0's disk
        fh.seek(offset + 100)
        byte = fh.read(1)
        fh.seek(offset + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    json_path = tmp_path / "rerun.json"
    rerun = run_cli([emulator.url(container), str(base / "{rank}"), "--no-progress", "--verify"], n=ranks,
                    env=emulator.key_env(), json_path=json_path)  # fmt: skip
    assert rerun.returncode == 0, rerun.output
    doc = rerun.json
    assert doc is not None and doc["resumed_files"] >= 1, doc
    # The changed block was not kept (its bytes fetched again), the others were.
    assert doc["resumed_bytes"] <= claimed - 4096, (doc["resumed_bytes"], claimed)
    for rank in range(ranks):
        copy = tree_of(base / str(rank))
        for rel, data in files.items():
            assert _md5(copy[rel]) == _md5(data), f"node {rank}: {rel} differs from its blob"


# -- a local SOURCE: its files' identity (localsource.py) ---------------------------------------

LOCAL = ["--bcast-chunk", "1MiB", "--bcast-pipeline", "1"]
LOCAL_SIZE = 4 * MiB  # four of them, read at about 6.7 MiB/s (slow_source.py): some 2.4 seconds
SLOW_SOURCE = str(Path(__file__).parent / "programs" / "slow_source.py")


def _stop_local(source: Path, base: Path, env: dict[str, str] | None = None) -> dict[str, int]:
    """A run from ``source`` (read slowly) stopped with SIGKILL once each node's journal holds 40 %;
    returns what node 0's journal claims."""
    cmd = [mpiexec_path(), "-n", str(RANKS), sys.executable, SLOW_SOURCE, str(source), str(base / "{rank}"),
           "--no-progress", *LOCAL]  # fmt: skip
    first = stop_halfway(cmd, {"AZCP_SLOW_READ": "0.15", **(env or {})}, [base / str(r) for r in range(RANKS)],
                         4 * LOCAL_SIZE, signal.SIGKILL, share=0.4)  # fmt: skip
    assert first.returncode != 0
    claims = journal_claims(base / "0")
    assert claims, "the first run journalled nothing"
    return claims


def _local_rerun(source: Path, base: Path) -> dict:  # type: ignore[type-arg]
    rerun = run_cli([str(source), str(base / "{rank}"), "--no-progress", "--verify", *LOCAL], n=RANKS,
                    json_path=base.parent / f"r{uuid.uuid4().hex[:6]}.json")  # fmt: skip
    assert rerun.returncode == 0, rerun.output
    assert rerun.json is not None
    return rerun.json


@pytest.fixture()
def local_source(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Four 4 MiB files whose change times have settled (localsource.SETTLED_NS): trusted."""
    files = {f"part-{i}.bin": pseudo_random(LOCAL_SIZE, f"local{i}{tmp_path}") for i in range(4)}
    for name, data in files.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(data)
    time.sleep(localsource.SETTLED_NS / 1e9 + 0.2)
    return tmp_path / "src", files


def test_a_stopped_copy_of_an_unchanged_local_source_is_resumed(
    local_source: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    source, files = local_source
    if localsource.filesystem_type(str(source)) not in localsource.CTIME_KEEPING:
        pytest.skip("the test directory's filesystem does not keep change times: nothing is resumed there")
    base = tmp_path / "d"
    claims = _stop_local(source, base)
    doc = _local_rerun(source, base)
    assert doc["resumed_files"] >= len(claims) and doc["resumed_bytes"] >= 0.9 * sum(claims.values()), doc
    _assert_copies(base, files)


# "replaced" (about 6 s) in CI's slow step.
@pytest.mark.parametrize("how", ["in-place", pytest.param("replaced", marks=pytest.mark.slow)])
def test_a_local_file_rewritten_with_its_size_and_mtime_between_the_runs_is_copied_whole(
    local_source: tuple[Path, dict[str, bytes]], tmp_path: Path, how: str
) -> None:
    # The stopped run's blocks are of the old bytes; the file is rewritten with new bytes of the
    # same size and its mtime put back: in place (cp -p over it, a build with a fixed
    # SOURCE_DATE_EPOCH) or as a new file renamed over it (rsync -t, tar x). Resumed, the copy
    # would be half old, half new, on every node alike (so --verify would agree).
    source, files = local_source
    base = tmp_path / "d"
    claims = _stop_local(source, base)
    for name in claims:
        path = source / name
        before = path.stat()
        files[name] = pseudo_random(len(files[name]), f"rewritten{name}")
        if how == "in-place":
            with open(path, "r+b") as fh:
                fh.write(files[name])
        else:
            (source / "new.tmp").write_bytes(files[name])
            os.replace(source / "new.tmp", path)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    time.sleep(localsource.SETTLED_NS / 1e9 + 0.2)  # settled again: only the identity tells
    doc = _local_rerun(source, base)
    assert doc["resumed_files"] <= len(set(files) - set(claims)), doc
    _assert_copies(base, files)


def test_a_local_source_whose_change_times_cannot_be_trusted_is_never_resumed(
    local_source: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    # On FUSE (blobfuse, s3fs) the daemon reports the times it likes: a rewrite may leave all of
    # them as they were. Such a file's blocks are never kept; it is copied whole.
    source, files = local_source
    base = tmp_path / "d"
    _stop_local(source, base, {"AZCP_FSTYPE": "0x65735546"})
    doc = _local_rerun(source, base)
    assert doc["resumed_files"] == 0 and doc["resumed_bytes"] == 0, doc
    _assert_copies(base, files)
