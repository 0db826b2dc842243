"""Hostile review of issue 38 ("no longer any way to get exit 0 with wrong bytes in a final file").

Each test is a way the reviewed change (3ca6623) still ended a job with exit 0 and wrong bytes
under a final name, as the reviewer reproduced it; each failed there and passes since the fixes
that followed the review (a body's range MD5 over plain HTTP, a receiver's claims never source
pieces nor kept under --verify, --verify stream's CRCs, a '-0000' date read as GMT). Real runs:
Azurite, ``mpiexec``, the fault proxy; two DESTs as two nodes.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.core.naming import JOURNAL_DIR
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.devtools.faultproxy import FaultProxy, Rule
from tests.conftest import run_cli, tree_of

CORRUPT_AFTER_DOWNLOAD = [str(Path(__file__).parent / "programs" / "corrupt_after_download.py")]


def _dataset(emulator: azurite.Emulator, sizes: dict[str, int], md5: bool) -> tuple[str, dict[str, bytes]]:
    """Blobs of ``sizes`` under d/, with or without a Content-MD5 (block uploads leave none)."""
    from azure.storage.blob import ContentSettings

    container = "rv" + uuid.uuid4().hex[:16]
    files = {name: pseudo_random(size, f"{container}/{name}") for name, size in sizes.items()}
    azurite.upload(emulator, container, {f"d/{name}": data for name, data in files.items()})
    client = azurite.container_client(emulator, container, create=False)
    if not md5:
        for name in files:
            client.get_blob_client(f"d/{name}").set_http_headers(
                ContentSettings(content_type="application/octet-stream")
            )
    assert all(bool(b.content_settings.content_md5) == md5 for b in client.list_blobs())
    return container, files


def _wrong_finals(base: Path, ranks: int, files: dict[str, bytes]) -> list[str]:
    """Every final file (not temporary, not the journal) whose bytes are not its blob's."""
    wrong = []
    for rank in range(ranks):
        for path, data in tree_of(base / str(rank)).items():
            if path in files and data != files[path]:
                wrong.append(f"node {rank}: {path}")
    return wrong


# -- 1. a hop flips a body byte, the blob has no Content-MD5 --------------------------------------


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_byte_flipped_on_the_way_without_content_md5_fails_verify(
    emulator: azurite.Emulator, tmp_path: Path, ranks: int
) -> None:
    """The proxy inverts one body byte of one ranged GET (past TCP's checksum; any http SOURCE, a
    TLS-terminating proxy, a NIC/driver bug). The downloader hashes the body as it arrives, so
    the "CRC of the bytes as they came from the source" is the CRC of the flipped bytes; every
    copy matches it, and with no Content-MD5 nothing else is compared: exit 0, wrong bytes under
    the final name on every node. test_faults.py only tests this with a Content-MD5."""
    sizes = {"a.bin": MiB + 1, "c.bin": 4 * MiB + 17}
    container, files = _dataset(emulator, sizes, md5=False)
    rules = [Rule("flip", blob="d/c.bin", nth=2, partial=1000)]
    with FaultProxy(emulator, rules) as proxy:
        result = run_cli(
            [proxy.url(container, "d"), str(tmp_path / "{rank}"), "--block-size", "1MiB", "--no-progress", "--verify"],
            n=ranks,
            env=emulator.key_env(),
            json_path=tmp_path / "r.json",
        )
    assert proxy.injected == 1 and proxy.errors == []
    wrong = _wrong_finals(tmp_path, ranks, files)
    assert not (result.returncode == 0 and wrong), f"exit 0 with wrong bytes: {wrong}\n{result.stdout}"
    assert result.returncode == 0 and not wrong, result.output  # the fix: asked again (a per-range hash)


# -- 2. a receiver's journalled claim is taken for the source's bytes -----------------------------


def test_a_block_corrupted_before_the_fanout_and_resumed_from_a_receiver_fails_verify(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    """Run 1 (--no-overlap, no --verify): one byte of a downloaded block flips on its node's disk
    after the block landed (its CRC taken, right) and before the fan-out read it; the other node
    receives the flipped block and journals it with the CRC of what it received. The run is
    stopped after the sync (a preemption before --verify and the rename).

    Run 2 (--verify): the downloader's node reads its claim back, finds it changed and drops it;
    the receiver's claim still matches its own bytes and is kept, so the plan sends the block
    from the receiver (peers before the source) instead of downloading it. finish.verify adds
    the receiver's claim to the source pieces: the composed "source" CRC is that of the flipped
    file, every copy matches it, no Content-MD5: exit 0, the flipped byte on both nodes."""
    sizes = {f"part-{i}.bin": 2 * MiB for i in range(2)}
    container, files = _dataset(emulator, sizes, md5=False)
    base = tmp_path / "d"
    env = {
        **emulator.key_env(),
        "AZCP_CORRUPT_FILE": "part-0.bin",
        "AZCP_CORRUPT_OFFSET": str(MiB + 100),
        "AZCP_STOP_AFTER_SYNC": "1",
    }
    opts = ["--block-size", "256KiB", "--bcast-chunk", "256KiB", "--no-overlap", "--no-progress"]
    first = run_cli([emulator.url(container, "d"), str(base / "{rank}"), *opts], n=2, env=env,
                    program=CORRUPT_AFTER_DOWNLOAD)  # fmt: skip
    assert first.returncode != 0, first.output
    assert all((base / str(r) / JOURNAL_DIR).is_dir() for r in range(2)), first.output
    assert not any(p in tree_of(base / str(r)) for r in range(2) for p in files), "run 1 renamed"
    rerun = run_cli([emulator.url(container, "d"), str(base / "{rank}"), "--no-progress", "--verify"], n=2,
                    env=emulator.key_env(), json_path=tmp_path / "r.json")  # fmt: skip
    assert rerun.json is not None and rerun.json["resumed_files"] >= 1, rerun.output
    wrong = _wrong_finals(base, 2, files)
    assert not (rerun.returncode == 0 and wrong), f"exit 0 with wrong bytes: {wrong}\n{rerun.stdout}"
    assert rerun.returncode == 0 and not wrong, rerun.output


# -- 3. --verify stream never checks against the source -------------------------------------------


def test_verify_stream_checks_the_streamed_bytes_against_the_source(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """One run, --no-overlap --verify stream, no Content-MD5: a byte of a downloaded block flips on
    its node's disk before the fan-out reads it. The downloader's CRC of that block (right) is in
    the source pieces, but a streamed file is not read back, so no CRC of it is compared with the
    source; the streamed MD5s all agree (every node got the same flipped bytes): exit 0."""
    sizes = {f"part-{i}.bin": 2 * MiB for i in range(2)}
    container, files = _dataset(emulator, sizes, md5=False)
    env = {**emulator.key_env(), "AZCP_CORRUPT_FILE": "part-0.bin", "AZCP_CORRUPT_OFFSET": str(MiB + 100)}
    opts = ["--block-size", "256KiB", "--bcast-chunk", "256KiB", "--no-overlap", "--no-progress"]
    result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), *opts, "--verify", "stream"], n=2,
                     env=env, program=CORRUPT_AFTER_DOWNLOAD, json_path=tmp_path / "r.json")  # fmt: skip
    wrong = _wrong_finals(tmp_path, 2, files)
    assert not (result.returncode == 0 and wrong), f"exit 0 with wrong bytes: {wrong}\n{result.stdout}"
    assert result.returncode == 7, result.output


def test_verify_disk_catches_a_block_corrupted_before_the_fanout(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """Control for 2 and 3 (sound today): the same flip in one run with --verify (disk) is caught
    against the downloader's CRC, exit 7, nothing wrong under a final name."""
    sizes = {f"part-{i}.bin": 2 * MiB for i in range(2)}
    container, files = _dataset(emulator, sizes, md5=False)
    env = {**emulator.key_env(), "AZCP_CORRUPT_FILE": "part-0.bin", "AZCP_CORRUPT_OFFSET": str(MiB + 100)}
    opts = ["--block-size", "256KiB", "--bcast-chunk", "256KiB", "--no-overlap", "--no-progress"]
    result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), *opts, "--verify"], n=2,
                     env=env, program=CORRUPT_AFTER_DOWNLOAD, json_path=tmp_path / "r.json")  # fmt: skip
    assert result.returncode == 7, result.output
    assert "as they came from the source" in result.stderr, result.stderr
    assert not _wrong_finals(tmp_path, 2, files)


# -- smaller: the answer checks -------------------------------------------------------------------


def test_a_last_modified_in_minus_0000_is_read_as_utc(monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 5322 dates with ``-0000`` (which email.utils gives as a naive datetime) are read in the
    machine's time zone: off UTC, _check_answer takes the listed blob for "changed" (exit 5)."""
    import time

    from azcp_cluster.download.httpwire import http_date

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert http_date("Mon, 01 Jan 2024 00:00:00 -0000") == http_date("Mon, 01 Jan 2024 00:00:00 GMT")
    finally:
        monkeypatch.undo()
        time.tzset()
