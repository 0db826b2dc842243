"""The streaming stage (download and fan-out at once) and the schedule as the engine's seam.

Real Azurite, real `mpiexec`: streaming and two-phase copies are identical; a node whose
other ranks download tells its leader what landed; a transfer goes out before the last
block of the download has landed; a failure of a non-leader downloader in the middle of
the stage ends every rank with its error and nothing under a final name; a schedule whose
receivers are a subset runs through the real engine.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.devtools.faultproxy import FaultProxy, Rule
from tests.conftest import REPO, Result, assert_copies, clean_env, mpiexec_path, run_cli, tree_of

# Large files cut into several transfers, small ones packed, one empty, nested paths.
SIZES = {
    "big.bin": 9 * MiB + 7,
    "mid/a.bin": 3 * MiB,
    "mid/b.bin": 2 * MiB - 1,
    "empty.bin": 0,
    **{f"small/s{i:03d}.txt": 37 * i + 1 for i in range(60)},
}
OPTIONS = ["--block-size", "1MiB", "--bcast-chunk", "2MiB", "--shard-size", "4MiB", "--no-progress"]
TIMELINE = REPO / "tests" / "programs" / "stream_timeline.py"
SUBSET = REPO / "tests" / "programs" / "subset_schedule.py"
BUG = REPO / "tests" / "programs" / "bug_in_download.py"
FANOUT_BUG = REPO / "tests" / "programs" / "bug_in_fanout.py"


def _one_error_nothing_wrong(
    result: Result, code: int, words: list[str], dests: list[Path], files: dict[str, bytes]
) -> None:
    """The run ended with ``code``, one error line holding every one of ``words``, no traceback,
    and no wrong file under a final name in any of ``dests`` (temporary names may stay)."""
    assert result.returncode == code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert len(errors) == 1 and all(word in errors[0] for word in words), result.stderr
    assert "Traceback" not in result.output
    for dest in dests:
        got = tree_of(dest)
        assert all(path.endswith(".azcp-part") or data == files[path] for path, data in got.items()), dest


def _dataset(emulator: azurite.Emulator) -> tuple[str, dict[str, bytes]]:
    container = "s" + uuid.uuid4().hex[:20]
    files = {path: pseudo_random(size, f"{container}/{path}") for path, size in SIZES.items()}
    azurite.upload(emulator, container, {f"d/{path}": data for path, data in files.items()})
    return container, files


@pytest.mark.parametrize("overlap", [True, False])
def test_streaming_and_two_phase_copies_are_identical(
    emulator: azurite.Emulator, tmp_path: Path, overlap: bool
) -> None:
    container, files = _dataset(emulator)
    extra = [] if overlap else ["--no-overlap"]
    result = run_cli(
        [emulator.url(container, "d"), str(tmp_path / "n" / "{rank}"), *OPTIONS, *extra],
        env=emulator.key_env(),
        json_path=tmp_path / "report.json",
    )
    assert result.returncode == 0, result.output
    assert_copies(tmp_path / "n", files)
    assert result.json is not None and result.json["overlap"] is overlap
    assert result.json["downloaded_bytes"] == sum(SIZES.values())  # each byte left the service once
    stages = result.json["stages"]
    if overlap:
        # Reported as both stages: the download inside the whole streamed stage.
        assert 0 < stages["download"]["seconds"] <= stages["bcast"]["seconds"]
        # Each leader downloads in its own process: its transfers leave from the download's
        # buffers, not read back from the disk (those beyond what the pool may keep are).
        assert 0 < result.json["sent_from_memory_bytes"] <= result.json["downloaded_bytes"]
    else:
        assert result.json["sent_from_memory_bytes"] == 0  # the download was over: its buffers too


def test_a_node_whose_other_ranks_download_streams_what_they_land(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """Four ranks, two nodes (DEST per rank pair): each leader sends what its node's other
    downloader fetched, told block by block."""
    container, files = _dataset(emulator)
    result = run_cli(
        [emulator.url(container, "d"), str(tmp_path / "n" / "{rank}"), *OPTIONS],
        env={**emulator.key_env(), "AZCP_TEST_PAIR_DEST": "1"},
        json_path=tmp_path / "report.json",
        program=[str(TIMELINE), str(tmp_path / "log")],
    )
    assert result.returncode == 0, result.output
    assert result.json is not None and result.json["writers"] == 2 and result.json["download_ranks"] == 4
    # What the other rank of a node fetched is in its buffers, not its leader's: read back.
    assert result.json["sent_from_memory_bytes"] < result.json["downloaded_bytes"]
    for pair in (0, 2):
        assert tree_of(tmp_path / "n" / str(pair)) == files
    assert not (tmp_path / "n" / "1").exists() and not (tmp_path / "n" / "3").exists()


def test_a_transfer_goes_out_before_the_download_ends(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """With the download paced (2 ranks, 8 MiB/s in all), each leader posts its first
    transfer long before its last block lands; two-phase, never."""
    container, files = _dataset(emulator)
    for overlap in (True, False):
        log = tmp_path / f"log-{overlap}"
        result = run_cli(
            [
                emulator.url(container, "d"),
                str(tmp_path / f"n-{overlap}" / "{rank}"),
                *OPTIONS,
                "--max-bandwidth",
                "8MiB/s",
                *([] if overlap else ["--no-overlap"]),
            ],
            n=2,
            env=emulator.key_env(),
            program=[str(TIMELINE), str(log)],
        )
        assert result.returncode == 0, result.output
        assert_copies(tmp_path / f"n-{overlap}", files, ranks=2)
        for rank in range(2):
            events = [json.loads(line) for line in (log / f"rank-{rank}.log").read_text().splitlines()]
            posts = [e["t"] for e in events if e["what"] == "post"]
            landed = [e["t"] for e in events if e["what"] == "landed"]
            assert posts and landed
            if overlap:
                assert min(posts) < max(landed) - 0.3, (rank, min(posts), max(landed))
            else:
                assert min(posts) > max(landed)


def test_a_failed_downloader_that_is_not_a_leader_ends_every_rank(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """One node of four ranks (one copy): rank 0 fans out what ranks 1 to 3 download. A blob
    that always fails (HTTP 500, no retries) ends every rank with one error naming it, and
    nothing under a final name is wrong."""
    container, files = _dataset(emulator)
    victim = "mid/a.bin"
    with FaultProxy(emulator, [Rule("500", blob=f"d/{victim}", times=1000)]) as proxy:
        result = run_cli(
            [proxy.url(container, "d"), str(tmp_path / "one"), *OPTIONS, "--max-retries", "0"],
            env=emulator.key_env(),
            json_path=tmp_path / "report.json",
        )
    _one_error_nothing_wrong(result, 5, [victim], [tmp_path / "one"], files)  # 5: a download error
    assert victim not in tree_of(tmp_path / "one")


@pytest.mark.parametrize("method", ["ibcast", "chain"])
def test_a_schedule_with_a_subset_of_receivers_runs_through_the_engine(tmp_path: Path, method: str) -> None:
    # A chain skips the ranks a transfer does not reach: file 1 goes 0 -> 2, past rank 1.
    proc = __import__("subprocess").run(
        [mpiexec_path(), "-n", "3", sys.executable, str(SUBSET), str(tmp_path), method],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        stdin=__import__("subprocess").DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {rank: json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(3)}
    assert lines[0]["have"] == {"0": True, "1": True, "2": True}  # the reader's own copy
    assert lines[1]["have"] == {"0": True, "2": True}  # file 1 never reached rank 1
    assert lines[2]["have"] == {"1": True, "2": True}  # file 0 never reached rank 2
    assert lines[0]["p2p"] > 0  # the subset transfers are point to point
    # Only files whose every byte passed a rank are hashed in flight there.
    assert lines[1]["digests"] == [0, 2] and lines[2]["digests"] == [1, 2]


@pytest.mark.slow  # CI's slow step (.ci/run): the default suite stays under 10 minutes
def test_a_node_whose_other_downloader_gets_nothing_still_finishes(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """Fewer pieces than downloaders (one small blob, a node of two ranks; or a rerun after one
    blob was added): the leader does not wait for an END from a downloader with no blocks."""
    container = "g" + uuid.uuid4().hex[:20]
    azurite.upload(emulator, container, {"d/one.bin": b"x" * 1000})
    result = run_cli(
        [emulator.url(container, "d"), str(tmp_path / "one"), "--no-progress"], n=2, env=emulator.key_env(), timeout=60
    )
    assert result.returncode == 0, result.output
    assert tree_of(tmp_path / "one") == {"one.bin": b"x" * 1000}
    # Two nodes of two ranks, a full copy, then one blob more: only one piece to download.
    container, files = _dataset(emulator)
    pairs = {"AZCP_TEST_PAIR_DEST": "1"}
    args = [emulator.url(container, "d"), str(tmp_path / "n" / "{rank}"), *OPTIONS]
    program = [str(TIMELINE), str(tmp_path / "log")]
    first = run_cli(args, env={**emulator.key_env(), **pairs}, program=program)
    assert first.returncode == 0, first.output
    azurite.upload(emulator, container, {"d/new.bin": b"new" * 100})
    again = run_cli(args, env={**emulator.key_env(), **pairs}, program=program, timeout=60)
    assert again.returncode == 0, again.output
    for pair in (0, 2):
        assert tree_of(tmp_path / "n" / str(pair)) == {**files, "new.bin": b"new" * 100}


def test_a_bug_in_a_leaders_download_thread_ends_the_job(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """Not an AzcpError: the streaming leader's download thread dies of a RuntimeError; every
    rank ends with exit 1 and one line naming it, within the test's timeout, nothing final."""
    container, files = _dataset(emulator)
    result = run_cli(
        [emulator.url(container, "d"), str(tmp_path / "n" / "{rank}"), *OPTIONS],
        n=2,
        env=emulator.key_env(),
        program=[str(BUG)],
        timeout=60,
    )
    dests = [tmp_path / "n" / str(rank) for rank in range(2)]
    _one_error_nothing_wrong(result, 1, ["rank 0", "simulated bug in the download"], dests, files)


def test_source_readers_with_a_blob_url_is_refused(tmp_path: Path) -> None:
    result = run_cli(
        ["http://127.0.0.1:9/devstoreaccount1/c", str(tmp_path / "{rank}"), "--source-readers", "2"], n=2, timeout=60
    )
    assert result.returncode == 2, result.output
    assert "--source-readers is for a local SOURCE" in result.stderr and "Traceback" not in result.output
    assert not any(tmp_path.iterdir())


def test_a_rerun_after_an_unannounced_failure_of_a_root_is_byte_identical(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    """Rank 0's fan-out fails before it has read a thing and tells no one, so it posts slots
    it never filled while rank 1 still takes them for data: rank 1 must write none of them
    (no zeros recorded as kept in its journal), and the rerun must make byte-identical copies."""
    container, files = _dataset(emulator)
    args = [emulator.url(container, "d"), str(tmp_path / "n" / "{rank}"), *OPTIONS]
    env = {**emulator.key_env(), "AZCP_TEST_BUG": "unannounced"}
    result = run_cli(args, n=2, env=env, program=[str(FANOUT_BUG)], timeout=60)
    dests = [tmp_path / "n" / str(rank) for rank in range(2)]
    _one_error_nothing_wrong(result, 6, ["rank 0", "simulated"], dests, files)
    rerun = run_cli(args, n=2, env=emulator.key_env(), timeout=60)
    assert rerun.returncode == 0, rerun.output
    for dest in dests:
        assert tree_of(dest) == files, f"{dest}: the rerun kept bytes rank 0 never sent"


@pytest.mark.parametrize(
    ("bug", "extra"),
    [
        ("retired", []),
        ("retired", ["--no-overlap"]),
        ("thread", []),
        ("readahead", []),
        ("readahead", ["--no-overlap"]),
        ("downloader", []),
    ],
)
def test_a_failure_outside_the_fan_out_machine_ends_every_rank(
    emulator: azurite.Emulator, tmp_path: Path, bug: str, extra: list[str]
) -> None:
    """Rank 0 fails in the driver's own bookkeeping, cannot start its download thread or its
    read-ahead, or cannot make its downloader: it goes on taking part until the next
    agreement, and every rank ends with one line, exit 1."""
    container, files = _dataset(emulator)
    result = run_cli(
        [emulator.url(container, "d"), str(tmp_path / "n" / "{rank}"), *OPTIONS, *extra],
        n=2,
        env={**emulator.key_env(), "AZCP_TEST_BUG": bug},
        program=[str(FANOUT_BUG)],
        timeout=60,
    )
    dests = [tmp_path / "n" / str(rank) for rank in range(2)]
    _one_error_nothing_wrong(result, 1, ["rank 0", "simulated"], dests, files)
