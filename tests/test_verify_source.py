"""``--verify`` against the source's CRC-32 (issue 38): every copy read back is compared with the
CRC of its file's bytes as they came from the source, composed from the pieces hashed where they
entered the run (downloaded blocks, a local SOURCE's reads, kept blocks). So a byte flipped in a
node's copy is found without a Content-MD5 and without another node to compare with: on one node,
and in a resumed file. Real runs: Azurite, ``mpiexec``."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import run_cli, tree_of
from tests.test_resume_runs import SMALL, SMALL_SIZE, _cmd, journal_claims, stop_halfway

CORRUPT = [str(Path(__file__).parent / "programs" / "corrupt_before_verify.py")]


def _no_md5_dataset(emulator: azurite.Emulator, size: int = SMALL_SIZE) -> tuple[str, dict[str, bytes]]:
    """Four blobs without a Content-MD5 (as block uploads leave large checkpoints)."""
    from azure.storage.blob import ContentSettings

    container = "vsrc" + uuid.uuid4().hex[:12]
    files = {f"part-{i}.bin": pseudo_random(size, f"v{i}{container}") for i in range(4)}
    azurite.upload(emulator, container, files)
    client = azurite.container_client(emulator, container, create=False)
    for name in files:
        client.get_blob_client(name).set_http_headers(ContentSettings(content_type="application/octet-stream"))
    assert not any(b.content_settings.content_md5 for b in client.list_blobs())
    return container, files


def _error_line(stderr: str) -> str:
    (line,) = [x for x in stderr.splitlines() if x.startswith("azcp-cluster: error")]
    return line


def test_every_copy_is_checked_against_the_source_and_passes(emulator: azurite.Emulator, tmp_path: Path) -> None:
    container, files = _no_md5_dataset(emulator, 3 * MiB + 5)
    result = run_cli([emulator.url(container), str(tmp_path / "{rank}"), "--no-progress", "--verify",
                      "--block-size", "1MiB"], n=2, env=emulator.key_env(), json_path=tmp_path / "r.json")  # fmt: skip
    assert result.returncode == 0, result.output
    assert (
        result.json is not None
        and result.json["verified_against_source"] == len(files) == result.json["verified_files"]
    )
    assert f"all copies match ({len(files)} against the source's CRC-32)" in result.stdout
    for rank in range(2):
        assert tree_of(tmp_path / str(rank)) == files


def test_a_byte_flipped_on_the_only_node_fails_verify_without_a_content_md5(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    """One node: nothing to compare with but the source. Before, exit 0 with the wrong byte."""
    container, _ = _no_md5_dataset(emulator, MiB + 17)
    env = {**emulator.key_env(), "AZCP_CORRUPT_RANK": "0", "AZCP_CORRUPT_FILE": "part-2.bin"}
    result = run_cli([emulator.url(container), str(tmp_path / "{rank}"), "--no-progress", "--verify"], n=1, env=env,
                     program=CORRUPT, json_path=tmp_path / "r.json")  # fmt: skip
    assert result.returncode == 7, result.output
    line = _error_line(result.stderr)
    assert "part-2.bin" in line and "rank(s) 0" in line and "as they came from the source" in line, line
    assert "part-2.bin" not in tree_of(tmp_path / "0"), "the flipped copy got its final name"


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_byte_flipped_in_a_resumed_file_fails_verify_without_a_content_md5(
    emulator: azurite.Emulator, tmp_path: Path, ranks: int
) -> None:
    """A resumed file had no hash of its kept blocks to compare with: now their journalled CRCs
    (checked when the rerun began) and the new blocks' compose the source's CRC."""
    container, files = _no_md5_dataset(emulator)
    base = tmp_path / "d"
    dests = [base / str(r) for r in range(ranks)]
    first = stop_halfway(_cmd(emulator.url(container), str(base / "{rank}"), *SMALL, n=ranks), emulator.key_env(),
                         dests, 4 * SMALL_SIZE, signal.SIGKILL, share=0.4, ranks=ranks)  # fmt: skip
    assert first.returncode != 0
    victim = sorted(journal_claims(dests[-1]))[0]  # a file the last node kept blocks of
    env = {**emulator.key_env(), "AZCP_CORRUPT_RANK": str(ranks - 1), "AZCP_CORRUPT_FILE": victim}
    result = run_cli([emulator.url(container), str(base / "{rank}"), "--no-progress", "--verify"], n=ranks, env=env,
                     program=CORRUPT, json_path=tmp_path / "r.json")  # fmt: skip
    assert result.returncode == 7, result.output
    assert result.json is not None and result.json["resumed_files"] >= 1
    line = _error_line(result.stderr)
    assert victim in line and (f"rank(s) {ranks - 1}" in line or f"rank {ranks - 1}:" in line), line
    # The same rerun, uncorrupted: every file is checked against the source, kept blocks included.
    # (The failed verify removed the journal: this rerun moves everything again.)
    again = run_cli([emulator.url(container), str(base / "{rank}"), "--no-progress", "--verify"], n=ranks,
                    env=emulator.key_env(), json_path=tmp_path / "again.json")  # fmt: skip
    assert again.returncode == 0, again.output
    assert again.json is not None and again.json["verified_against_source"] == len(files)
    for rank in range(ranks):
        assert tree_of(base / str(rank)) == files


def test_a_resumed_copy_is_checked_against_the_source_whole(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """The kept blocks' CRCs and the new blocks' tile every resumed file: all of them checked."""
    container, files = _no_md5_dataset(emulator)
    base = tmp_path / "d"
    dests = [base / str(r) for r in range(2)]
    first = stop_halfway(_cmd(emulator.url(container), str(base / "{rank}"), *SMALL), emulator.key_env(),
                         dests, 4 * SMALL_SIZE, signal.SIGKILL, share=0.4)  # fmt: skip
    assert first.returncode != 0
    result = run_cli([emulator.url(container), str(base / "{rank}"), "--no-progress", "--verify"], n=2,
                     env=emulator.key_env(), json_path=tmp_path / "r.json")  # fmt: skip
    assert result.returncode == 0, result.output
    doc = result.json
    assert doc is not None and doc["resumed_files"] >= 1 and doc["resumed_bytes"] > 0
    assert doc["verified_against_source"] == len(files), doc
    for rank in range(2):
        assert tree_of(base / str(rank)) == files


def test_a_local_source_is_checked_against_its_reads(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    files = {f"f{i}.bin": pseudo_random(MiB + 1000 * i, f"local{i}") for i in range(3)}
    for name, data in files.items():
        (source / name).write_bytes(data)
    result = run_cli([str(source), str(tmp_path / "{rank}"), "--no-progress", "--verify"], n=2,
                     json_path=tmp_path / "r.json")  # fmt: skip
    assert result.returncode == 0, result.output
    assert result.json is not None and result.json["verified_against_source"] == len(files)
