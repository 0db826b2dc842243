"""Faults on the wire: the job runs through a fault-injecting proxy in front of the real Azurite.

Each fault kind hits some ranged GETs of one blob; the copy must still complete byte-identical
on every rank, with the retries counted by cause. A blob replaced (or deleted) during the copy
must end the job with exit 5 and one line naming it and saying "changed" (or "deleted"), and
leave no wrong file under a final name.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.core.errors import UsageError
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.devtools.faultproxy import FaultProxy, Rule, Seen
from azcp_cluster.options import config_from_args
from tests.conftest import Result, run_cli, tree_of

RANKS = 4
SIZES = {"a.bin": 1 * MiB + 1, "b.bin": 2 * MiB - 5, "c.bin": 4 * MiB + 17, "sub/d.bin": 6 * MiB}
VICTIM = "c.bin"  # the blob the faults hit: five 1 MiB blocks
OPTIONS = ["--block-size", "1MiB", "--no-progress"]
READ_TIMEOUT = 2.0  # for the stall case; the proxy stalls for longer
STALL = 6.0

# Fault kind -> the retry cause the tool reports for it. A body cut short is one cause,
# whether by a reset or by a clean close before Content-Length.
CAUSES = {
    "503": "503",
    "500": "500",
    "reset": "truncated body",
    "stall": "timeout",
    "truncate": "truncated body",
    # Answers that are not what was asked: never written, asked again.
    "shift": "wrong Content-Range",
    "no-range": "HTTP 200 for a ranged GET",
}


def _dataset(emulator: azurite.Emulator) -> tuple[str, dict[str, bytes]]:
    """A fresh container with the files under prefix d/; returns it and path -> content."""
    container = "f" + uuid.uuid4().hex[:20]
    files = {path: pseudo_random(size, f"{container}/{path}") for path, size in SIZES.items()}
    azurite.upload(emulator, container, {f"d/{path}": data for path, data in files.items()})
    return container, files


def _final_names_right(base: Path, expected: dict[str, bytes], victim_here: bool = False) -> None:
    """On every rank: the victim under its final name only if ``victim_here``, and every file
    under a final name right (temporary names may stay)."""
    for rank in range(RANKS):
        got = tree_of(base / str(rank))
        assert (VICTIM in got) == victim_here, f"rank {rank}: the victim {'missing' if victim_here else 'stands'}"
        for path, data in got.items():
            if not path.endswith(".azcp-part"):
                assert data == expected[path], f"rank {rank}: {path} is under its final name but wrong"


@dataclass
class Outcome:
    """One faulted run: the CLI's result, what the proxy did, and the expected files."""

    result: Result
    log: list[Seen]
    injected: int
    proxy_errors: list[str]
    expected: dict[str, bytes]
    dest: Path


class Faulted:
    """One run of the job per fault kind (two faulted requests each), made when a test first
    asks for that kind and shared by the tests that look at it."""

    def __init__(self, emulator: azurite.Emulator, tmp: pytest.TempPathFactory) -> None:
        self.emulator, self.tmp = emulator, tmp
        self.outcomes: dict[str, Outcome] = {}

    def __getitem__(self, kind: str) -> Outcome:
        if kind not in self.outcomes:
            self.outcomes[kind] = self._run(kind)
        return self.outcomes[kind]

    def _run(self, kind: str) -> Outcome:
        container, expected = _dataset(self.emulator)
        dest = self.tmp.mktemp(f"fault-{kind}")
        rules = [Rule(kind, blob=f"d/{VICTIM}", nth=2, times=2, stall=STALL)]
        extra = ["--read-timeout", str(READ_TIMEOUT)] if kind == "stall" else []
        with FaultProxy(self.emulator, rules) as proxy:
            result = run_cli(
                [proxy.url(container, "d"), str(dest / "{rank}"), *OPTIONS, *extra],
                env=self.emulator.key_env(),
                json_path=dest / "report.json",
            )
        return Outcome(result, proxy.log, proxy.injected, proxy.errors, expected, dest)


@pytest.fixture(scope="module")
def faulted(emulator: azurite.Emulator, tmp_path_factory: pytest.TempPathFactory) -> Faulted:
    """The faulted runs of this module, each made once."""
    return Faulted(emulator, tmp_path_factory)


# A 503, a reset connection, a stalled body (the read timeout seen firing) and another range
# than the one asked in the default suite; a 500, a body cut short and a 200 for a ranged GET
# (each also unit-tested: test_retry.py, test_http1.py, test_answers.py) in CI's slow step, so
# that the default suite stays under 10 minutes.
KINDS = [k if k in ("503", "reset", "stall", "shift") else pytest.param(k, marks=pytest.mark.slow) for k in CAUSES]


@pytest.mark.parametrize("kind", KINDS)
def test_copy_survives_the_fault_and_counts_the_retries(faulted: Faulted, kind: str) -> None:
    out = faulted[kind]
    assert out.result.returncode == 0, out.result.output
    assert out.proxy_errors == []
    assert out.injected == 2, out.log
    assert [s.blob for s in out.log if s.fault] == [f"d/{VICTIM}"] * 2
    for rank in range(RANKS):
        assert tree_of(out.dest / str(rank)) == out.expected, f"rank {rank}"
    assert not list(out.dest.rglob("*.azcp-part"))
    doc = out.result.json
    assert doc is not None and doc["exit_code"] == 0
    # Each faulted request is retried once, and nothing else is (with the short read timeout
    # of the stall case, a slow but healthy response on a loaded machine may time out too).
    causes = doc["retry_causes"]
    if kind == "stall":
        # (A healthy body that a loaded machine slows under 4 KiB/s for the 2 s is a "slow body".)
        assert set(causes) <= {"timeout", "slow body"} and causes["timeout"] >= out.injected, causes
        assert doc["retries"] == sum(causes.values())
    else:
        assert doc["retries"] == out.injected
        assert causes == {CAUSES[kind]: out.injected}
    said = ", ".join(f"{k}={v}" for k, v in sorted(causes.items()))
    assert f"[cluster] retries: {doc['retries']} ({said}) by rank" in out.result.stdout
    assert len(doc["retries_by_rank"]) == 4 and sum(doc["retries_by_rank"]) == doc["retries"]
    # Every faulted range was asked for again, and the listing went through untouched.
    for seen in out.log:
        if seen.fault:
            assert any(s.range == seen.range and s.at > seen.at and not s.fault for s in out.log if s.blob == seen.blob)
    assert any(s.method == "GET" and not s.blob for s in out.log)  # the listing (comp=list)


def test_retry_after_is_honoured(faulted: Faulted) -> None:
    """After a 503 with Retry-After: 1 the range comes back no sooner than 1 s (the backoff alone: 0.25-0.5 s)."""
    log = faulted["503"].log
    busy = [s for s in log if s.fault == "503"]
    assert len(busy) == 2
    for seen in busy:
        retried = [s.at for s in log if s.blob == seen.blob and s.range == seen.range and s.at > seen.at]
        assert retried, f"{seen.range} was not retried"
        assert min(retried) - seen.at >= 1.0


def test_stalled_body_is_abandoned_after_the_read_timeout(faulted: Faulted) -> None:
    """The proxy stalls for 6 s; with --read-timeout 2 the tool gives up on the body and retries before that."""
    log = faulted["stall"].log
    for seen in (s for s in log if s.fault == "stall"):
        retried = min(s.at for s in log if s.blob == seen.blob and s.range == seen.range and s.at > seen.at)
        assert READ_TIMEOUT <= retried - seen.at < STALL


def test_a_failed_run_reports_the_figures_it_reached(emulator: azurite.Emulator, tmp_path: Path) -> None:
    # A 503 storm on one blob outlasts --max-retries: the run fails (exit 5), and its report
    # still says what happened up to then: the retries and their cause, the bytes that did
    # arrive, the mode, and the lines of the stages it reached before the error line.
    container, _ = _dataset(emulator)
    rules = [Rule("503", blob=f"d/{VICTIM}", nth=1, times=1000, retry_after=0)]
    with FaultProxy(emulator, rules) as proxy:
        result = run_cli(
            # 3 retries: 1.75 s at the least for the other blobs' blocks to arrive meanwhile.
            [proxy.url(container, "d"), str(tmp_path / "{rank}"), *OPTIONS, "--max-retries", "3"],
            env=emulator.key_env(),
            json_path=tmp_path / "report.json",
        )
    assert result.returncode == 5, result.output
    doc = result.json
    assert doc is not None and doc["exit_code"] == 5 and "giving up after 3 retries" in doc["error"]
    assert doc["retries"] >= 3 and doc["retry_causes"].get("503", 0) == doc["retries"], doc
    assert sum(doc["retries_by_rank"]) == doc["retries"]
    assert doc["downloaded_bytes"] > 0 and doc["overlap"] is True, doc  # the other blobs' blocks arrived
    assert doc["stages"]["download"]["seconds"] > 0 and doc["stages"]["bcast"]["seconds"] > 0, doc["stages"]
    lines = result.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines][:3] == ["[cluster]", "[list]", "[diff]"], result.stdout
    assert lines[-1].startswith("[total] ") and any(line.startswith("[cluster] retries: ") for line in lines)
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert error == doc["error"]


def test_blob_replaced_during_the_copy_exits_5_and_leaves_no_wrong_file(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    container, expected = _dataset(emulator)
    replaced: list[bool] = []

    def replace_victim() -> None:  # same size, new content, new ETag: only the ETag can tell
        azurite.upload(emulator, container, {f"d/{VICTIM}": pseudo_random(SIZES[VICTIM], "the new version")})
        replaced.append(True)

    with FaultProxy(emulator, [Rule("pass", blob=f"d/{VICTIM}", before=replace_victim)]) as proxy:
        result = run_cli(
            [proxy.url(container, "d"), str(tmp_path / "{rank}"), *OPTIONS],
            env=emulator.key_env(),
            json_path=tmp_path / "report.json",
        )
    assert replaced == [True] and proxy.injected == 1 and proxy.errors == []
    assert result.returncode == 5, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert len(errors) == 1, result.stderr
    assert f"d/{VICTIM}" in errors[0] and "changed" in errors[0]
    assert "Traceback" not in result.output
    assert result.json is not None and result.json["exit_code"] == 5 and VICTIM in result.json["error"]
    _final_names_right(tmp_path, expected)


def test_a_hop_that_drops_if_match_cannot_tear_a_file(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """A hop drops If-Match from the third ranged GET of the victim on, and the blob is replaced
    (same size) just before that GET: the answers carry the new ETag, which the tool compares
    with the listed one, so the job ends with exit 5 saying "changed" instead of writing a file
    of old and new blocks."""
    container, expected = _dataset(emulator)
    replaced: list[bool] = []

    def replace_once() -> None:
        if not replaced:
            azurite.upload(emulator, container, {f"d/{VICTIM}": pseudo_random(SIZES[VICTIM], "the new version")})
            replaced.append(True)

    rules = [Rule("drop-if-match", blob=f"d/{VICTIM}", nth=3, times=1000, before=replace_once)]
    with FaultProxy(emulator, rules) as proxy:
        result = run_cli(
            [proxy.url(container, "d"), str(tmp_path / "{rank}"), *OPTIONS],
            env=emulator.key_env(),
            json_path=tmp_path / "report.json",
        )
    assert replaced == [True] and proxy.injected >= 1 and proxy.errors == []
    assert result.returncode == 5, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert len(errors) == 1, result.stderr
    assert f"d/{VICTIM}" in errors[0] and "changed" in errors[0]
    assert "Traceback" not in result.output
    _final_names_right(tmp_path, expected)


@pytest.mark.parametrize("block", ["1MiB", "8MiB"])
def test_a_byte_flipped_on_the_way_is_asked_again_or_fails_verify(
    emulator: azurite.Emulator, tmp_path: Path, block: str
) -> None:
    """A byte of a body inverted between the emulator and the tool (past TCP's checksum; over
    https TLS would refuse it). Over plain HTTP a range of 4 MiB or less comes with the
    service's MD5 of it: the body is refused before a block lands, asked again, and the copy is
    byte-identical. A larger range has none: ``--verify`` compares every copy with the blob's
    Content-MD5 and ends the job with exit 7 naming the file, nothing wrong under a final name."""
    container, expected = _dataset(emulator)
    rules = [Rule("flip", blob=f"d/{VICTIM}", nth=1 if block == "8MiB" else 2, partial=1000)]
    with FaultProxy(emulator, rules) as proxy:
        result = run_cli(
            [proxy.url(container, "d"), str(tmp_path / "{rank}"), "--block-size", block, "--no-progress", "--verify"],
            env=emulator.key_env(),
            json_path=tmp_path / "report.json",
        )
    assert proxy.injected == 1 and proxy.errors == []
    if block == "1MiB":
        assert result.returncode == 0, result.output
        assert result.json is not None and result.json["retry_causes"] == {"wrong Content-MD5": 1}
    else:
        assert result.returncode == 7, result.output
        errors = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
        assert len(errors) == 1 and VICTIM in errors[0] and "Content-MD5" in errors[0], result.stderr
    _final_names_right(tmp_path, expected, victim_here=block == "1MiB")


def test_blob_deleted_during_the_copy_exits_5_saying_deleted(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """A conditional GET of a deleted blob may be answered 412 (as for a replaced one): the tool
    asks the service whether the blob is still there, and says "deleted", not "changed"."""
    container, expected = _dataset(emulator)
    deleted: list[bool] = []

    def delete_victim() -> None:  # before the first ranged GET of the victim reaches the emulator
        azurite.delete(emulator, container, [f"d/{VICTIM}"])
        deleted.append(True)

    with FaultProxy(emulator, [Rule("pass", blob=f"d/{VICTIM}", before=delete_victim)]) as proxy:
        result = run_cli(
            [proxy.url(container, "d"), str(tmp_path / "{rank}"), *OPTIONS],
            env=emulator.key_env(),
            json_path=tmp_path / "report.json",
        )
    assert deleted == [True] and proxy.injected == 1 and proxy.errors == []
    assert result.returncode == 5, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert len(errors) == 1, result.stderr
    assert f"d/{VICTIM}" in errors[0] and "deleted" in errors[0] and "changed" not in errors[0], errors[0]
    assert "Traceback" not in result.output
    assert result.json is not None and result.json["exit_code"] == 5 and "deleted" in result.json["error"]
    # The tool asked whether the blob is still there: a HEAD of it, after the failed GET.
    failed_get = next(s for s in proxy.log if s.fault)
    assert any(s.method == "HEAD" and s.blob == f"d/{VICTIM}" and s.at >= failed_get.at for s in proxy.log)
    _final_names_right(tmp_path, expected)


def test_proxy_passes_listing_and_properties_and_counts_ranged_gets(emulator: azurite.Emulator) -> None:
    """Through the azure SDK (no retries): only the picked ranged GET fails, with Azure's 503 shape."""
    from azure.core.exceptions import HttpResponseError
    from azure.storage.blob import BlobServiceClient

    container, expected = _dataset(emulator)
    rule = Rule("503", blob="d/b*", nth=2)
    with FaultProxy(emulator, [rule]) as proxy:
        through_proxy = emulator.connection_string.replace(emulator.endpoint, proxy.endpoint)
        service = BlobServiceClient.from_connection_string(through_proxy, retry_total=0)
        client = service.get_container_client(container)
        assert sorted(b.name for b in client.list_blobs(name_starts_with="d/")) == sorted(f"d/{p}" for p in SIZES)
        blob = client.get_blob_client("d/b.bin")
        assert blob.get_blob_properties().size == SIZES["b.bin"]
        assert blob.download_blob(offset=10, length=1000).readall() == expected["b.bin"][10:1010]
        with pytest.raises(HttpResponseError) as busy:
            blob.download_blob(offset=0, length=100).readall()
        assert busy.value.status_code == 503 and busy.value.error_code == "ServerBusy"
        assert busy.value.response.headers["Retry-After"] == "1"
        assert blob.download_blob(offset=5, length=7).readall() == expected["b.bin"][5:12]
        other = client.get_blob_client("d/a.bin").download_blob(offset=0, length=64).readall()
        assert other == expected["a.bin"][:64]
    assert proxy.injected == 1 and rule.seen == 3 and proxy.errors == []
    assert [s.fault for s in proxy.log if s.method == "GET" and s.blob == "d/b.bin"] == ["", "503", ""]


def test_read_timeout_option() -> None:
    args = ["http://127.0.0.1:1/acct/c", "/tmp/x"]
    assert config_from_args(args).read_timeout == 60.0
    assert config_from_args([*args, "--read-timeout", "2.5"]).read_timeout == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(UsageError, match="--read-timeout"):
            config_from_args([*args, "--read-timeout", bad])
