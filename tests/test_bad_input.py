"""Bad input, case by case: one clear line, the documented exit code, nothing written outside
DEST, and no secret (account key, SAS signature) in any output, the JSON report included."""

from __future__ import annotations

import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from azcp_cluster.core.naming import MAX_SEGMENT_BYTES
from azcp_cluster.devtools import azurite
from tests.conftest import Result, run_cli

WRONG_KEY = "QmFkS2V5Rm9yVGVzdHNPbmx5QmFkS2V5Rm9yVGVzdHNPbmx5QmFkS2V5Rm9yVGVzdHM="
FORGED_SIG = "Zm9yZ2VkLXNpZ25hdHVyZS1mb3ItdGVzdHMtb25seQ=="


@dataclass
class Case:
    """One bad invocation: SOURCE (from the emulator), extra arguments, environment, outcome."""

    source: Callable[[azurite.Emulator, str], str]
    code: int
    words: str
    args: list[str] = field(default_factory=list)
    env: Callable[[azurite.Emulator], dict[str, str]] = azurite.Emulator.key_env
    dest: str = "sandbox/{rank}"
    warning: bool = False  # exit 0 with one warning instead of an error
    json_dir: bool = False  # the --json PATH is an existing (empty) directory: it must stay empty


def _url(prefix: str = "p") -> Callable[[azurite.Emulator, str], str]:
    return lambda emu, container: emu.url(container, prefix)


def _sas_url(sig: str) -> Callable[[azurite.Emulator, str], str]:
    def make(emu: azurite.Emulator, container: str) -> str:
        from azure.storage.blob import ContainerSasPermissions, generate_container_sas

        sas = generate_container_sas(
            azurite.ACCOUNT,
            container,
            account_key=azurite.ACCOUNT_KEY,
            permission=ContainerSasPermissions(read=True, list=True),
            expiry=datetime.now(timezone.utc) + timedelta(hours=1),
        )
        query = urllib.parse.parse_qs(sas)
        query["sig"] = [sig]
        return emu.url(container, "p") + "?" + urllib.parse.urlencode(query, doseq=True)

    return make


CASES: dict[str, Case] = {
    "malformed-url": Case(lambda e, c: "http://[::1/x/y", 2, "malformed"),
    "unknown-scheme": Case(lambda e, c: f"ftp://127.0.0.1/{azurite.ACCOUNT}/{c}", 2, "scheme"),
    "missing-account": Case(lambda e, c: f"http://{e.host}:{e.port}/", 2, "account"),
    "endpoint-refused": Case(
        lambda e, c: f"http://127.0.0.1:{azurite.free_port()}/{azurite.ACCOUNT}/{c}",
        3,
        "): connection refused",
        args=["--max-retries", "0"],
    ),
    "missing-container": Case(lambda e, c: e.url("no-such-container-" + c[:8]), 3, "not found"),
    "no-credentials": Case(_url(), 3, "access denied", env=lambda e: {}),
    "wrong-key": Case(
        _url(),
        3,
        "access denied",
        env=lambda e: {"AZURE_STORAGE_ACCOUNT": azurite.ACCOUNT, "AZURE_STORAGE_KEY": WRONG_KEY},
    ),
    "forged-sas": Case(_sas_url(FORGED_SIG), 3, "access denied", env=lambda e: {}),
    "dest-is-a-file": Case(_url(), 8, "not a directory", dest="afile"),
    "dest-not-writable": Case(_url(), 8, "DEST", dest="/proc/azcp-cluster-test/{rank}"),
    "names-collide": Case(_url("collide"), 3, "both a file and the directory"),
    "reserved-manifest-name": Case(_url("reserved"), 3, "reserved for the tool's manifest"),
    "reserved-temp-name": Case(_url("temp"), 3, "reserved for the tool's temporary files"),
    "empty-segment": Case(_url("empty"), 3, "empty segment"),
    "name-too-long": Case(_url("long"), 3, "too long for the filesystem"),
    "zero-chunk": Case(_url(), 2, "--bcast-chunk must be between", args=["--bcast-chunk", "0"]),
    "negative-block": Case(_url(), 2, "--block-size", args=["--block-size", "-1"]),
    "zero-concurrency": Case(_url(), 2, "--concurrency must be between 1 and 4096", args=["--concurrency", "0"]),
    "zero-bandwidth": Case(_url(), 2, "--max-bandwidth", args=["--max-bandwidth", "0"]),
    "bad-size-unit": Case(_url(), 2, "invalid size unit", args=["--shard-size", "3parsecs"]),
    "unknown-option": Case(_url(), 2, "unrecognized option --frobnicate (see --help)", args=["--frobnicate"]),
    "misspelled-option": Case(
        _url(), 2, "unrecognized option --bcast-chunks (did you mean --bcast-chunk?)", args=["--bcast-chunks", "1MiB"]
    ),
    # Within the options' ranges (16 GiB x 256 slots), beyond any machine's memory:
    "beyond-memory": Case(_url(), 2, "available", args=["--bcast-chunk", "16GiB", "--bcast-pipeline", "256"]),
    "bad-compare": Case(_url(), 2, "--compare", args=["--compare", "sha1"]),
    # A prefix or filters that yield nothing: a typo in a job script, exit 3 naming it (issue 25).
    "empty-prefix": Case(_url("nothing-here"), 3, "(prefix 'nothing-here') holds no file to copy; a typo in SOURCE?"),
    "filters-leave-nothing": Case(_url(), 3, "--include *.nope left none of its 1 files", args=["--include", "*.nope"]),
    "empty-prefix-allowed": Case(_url("nothing-here"), 0, "matched no files", args=["--allow-empty"], warning=True),
    # Every numeric option has a range (issue 13): below it a run crawls, above it something
    # overflows later; refused at once, in one line.
    "block-size-one-byte": Case(_url(), 2, "--block-size must be between 64.00 KiB", args=["--block-size", "1"]),
    "block-size-2GiB": Case(_url(), 2, "--block-size must be between", args=["--block-size", "2GiB"]),
    "block-size-400-digits": Case(_url(), 2, "--block-size must be between", args=["--block-size", "9" * 400]),
    "bcast-chunk-one-byte": Case(_url(), 2, "--bcast-chunk must be between 64.00 KiB", args=["--bcast-chunk", "1"]),
    "bcast-chunk-32GiB": Case(_url(), 2, "--bcast-chunk must be between", args=["--bcast-chunk", "32GiB"]),
    "shard-size-one-byte": Case(_url(), 2, "--shard-size must be at least 64.00 KiB", args=["--shard-size", "1"]),
    "shard-size-5000-digits": Case(_url(), 2, "--shard-size", args=["--shard-size", "9" * 5000]),
    "bandwidth-400-digits": Case(_url(), 2, "--max-bandwidth", args=["--max-bandwidth", "9" * 400]),
    "bandwidth-5000-digits": Case(_url(), 2, "--max-bandwidth", args=["--max-bandwidth", "9" * 5000 + "Gbps"]),
    "read-timeout-1e300": Case(_url(), 2, "--read-timeout must be at least 0.1", args=["--read-timeout", "1e300"]),
    "read-timeout-nan": Case(_url(), 2, "--read-timeout must be at least 0.1", args=["--read-timeout", "nan"]),
    "read-timeout-inf": Case(_url(), 2, "--read-timeout must be at least 0.1", args=["--read-timeout", "inf"]),
    "read-timeout-1e-320": Case(_url(), 2, "--read-timeout must be at least 0.1", args=["--read-timeout", "1e-320"]),
    "bandwidth-a-bit-a-second": Case(_url(), 2, "--max-bandwidth must be at least", args=["--max-bandwidth", "1bps"]),
    "read-timeout-a-day-and-more": Case(_url(), 2, "at most 86400", args=["--read-timeout", "86401"]),
    "concurrency-99999": Case(_url(), 2, "--concurrency must be between 1 and 4096", args=["--concurrency", "99999"]),
    "concurrency-5000-digits": Case(_url(), 2, "argument --concurrency", args=["--concurrency", "9" * 5000]),
    "max-retries-negative": Case(_url(), 2, "--max-retries must be between 0 and 100", args=["--max-retries", "-1"]),
    "max-retries-1000": Case(_url(), 2, "--max-retries must be between 0 and 100", args=["--max-retries", "1000"]),
    "bcast-writers-zero": Case(_url(), 2, "--bcast-writers must be between 1", args=["--bcast-writers", "0"]),
    "bcast-pipeline-zero": Case(_url(), 2, "--bcast-pipeline must be between 1", args=["--bcast-pipeline", "0"]),
    "download-ranks-zero": Case(_url(), 2, "--download-ranks must be at least 1", args=["--download-ranks", "0"]),
    "source-rank-negative": Case(_url(), 2, "--source-rank must be zero or more", args=["--source-rank", "-1"]),
    "lock-bogus": Case(_url(), 2, "argument --lock: invalid choice: 'bogus'", args=["--lock", "bogus"]),
    "lock-timeout-zero": Case(_url(), 2, "--lock-timeout must be at least 0.1", args=["--lock-timeout", "0"]),
    "lock-timeout-negative": Case(_url(), 2, "--lock-timeout must be at least 0.1", args=["--lock-timeout", "-5"]),
    "lock-timeout-a-year": Case(_url(), 2, "at most 604800", args=["--lock-timeout", "31536000"]),
    "verify-bogus": Case(_url(), 2, "argument --verify: invalid choice: 'bogus'", args=["--verify=bogus"]),
    "json-onto-a-directory": Case(_url(), 2, "is a directory", json_dir=True),
    # A control character in SOURCE or DEST (exit 2, before anything is made). URL parsing drops
    # a tab or a line break: the tab in the container's name copied from the container without it.
    "tab-in-the-container": Case(
        lambda emu, c: emu.url(c[:3] + "\t" + c[3:], "p"), 2, "SOURCE has a control character (U+0009, '\\t') at"
    ),
    "line-break-before-the-sas": Case(
        lambda emu, c: _sas_url(FORGED_SIG)(emu, c).replace("?", "\r\n?"), 2, "(U+000D, '\\r') at character"
    ),
    "delete-in-dest": Case(_url(), 2, "DEST has a control character (U+007F, '\\x7f') at", dest="sandbox/{rank}\x7f"),
    # The tool's own names at any level of a path, not only at its end (exit 3):
    "reserved-temp-directory": Case(_url("deep"), 3, "reserved for the tool's temporary files"),
    "reserved-manifest-directory": Case(_url("deep2"), 3, "reserved for the tool's manifest"),
    "reserved-manifest-below-the-top": Case(_url("deep3"), 3, "reserved for the tool's manifest"),
    "reserved-lock-name": Case(_url("lock"), 3, "reserved for the tool's lock file"),
    "reserved-lock-below-the-top": Case(_url("lock2"), 3, "reserved for the tool's lock file"),
}


@pytest.fixture(scope="module")
def container(emulator: azurite.Emulator) -> str:
    """A private container holding a good prefix and one prefix per kind of bad name.

    Names with ``..`` cannot even be uploaded (clients resolve the dot segments); the naming
    unit tests cover them.
    """
    name = "bad" + uuid.uuid4().hex[:16]
    azurite.upload(
        emulator,
        name,
        {
            "p/ok.bin": b"fine",
            "collide/a": b"file",
            "collide/a/b": b"needs a as a directory",
            "reserved/.azcp-manifest.json": b"{}",
            "temp/x.bin.azcp-part": b"half",
            "deep/x.azcp-part/y": b"a directory named like a temporary file",
            "deep2/d/.azcp-manifest.json/x": b"a directory named like the manifest",
            "deep3/d/.azcp-manifest.json": b"{}",
            "lock/.azcp-lock": b"a file named like the lock",
            "lock2/d/.azcp-lock": b"a file named like the lock, deeper",
            "empty/x//y.bin": b"alias",
            "long/" + "n" * (MAX_SEGMENT_BYTES + 1): b"too long",
        },
    )
    return name


def _secrets(result: Result) -> str:
    text = result.stdout + result.stderr
    return text + (repr(result.json) if result.json is not None else "")


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, emulator: azurite.Emulator, container: str, tmp_path: Path) -> None:
    case = CASES[name]
    work = tmp_path / "work"  # the current directory: nothing may appear here
    work.mkdir()
    (tmp_path / "afile").write_text("not a directory")
    dest = case.dest if case.dest.startswith("/") else str(tmp_path / case.dest)
    report = tmp_path / "report.json"
    if case.json_dir:  # --json onto a directory: passed by hand, the harness would read it back
        report.mkdir()
    result = run_cli(
        [case.source(emulator, container), dest, *case.args, *(["--json", str(report)] if case.json_dir else [])],
        env=case.env(emulator),
        json_path=None if case.json_dir else report,
        n=2,
        cwd=work,
    )
    if case.json_dir:
        assert report.is_dir() and list(report.iterdir()) == [], "a file was left in the --json directory"
    assert result.returncode == case.code, result.output
    assert "Traceback" not in result.output
    kind = "warning" if case.warning else "error"
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"azcp-cluster: {kind}")]
    assert len(lines) == 1, result.stderr
    assert case.words in lines[0], lines[0]
    if not case.warning:
        assert "azcp-cluster: error" not in result.stdout
        if not case.json_dir:  # every error writes the JSON report, a range error's too
            assert result.json is not None, "no JSON report"
            assert result.json["exit_code"] == case.code and result.json["error"] == lines[0], result.json
    # Nothing outside DEST: the working directory stays empty, and only DEST may appear.
    assert list(work.iterdir()) == []
    allowed = {"work", "afile", "report.json", "sandbox"}
    assert {p.name for p in tmp_path.iterdir()} <= allowed
    written = [p for p in (tmp_path / "sandbox").rglob("*") if p.is_file()] if (tmp_path / "sandbox").exists() else []
    assert not [p for p in written if p.name != ".azcp-manifest.json"], written
    # No secret in any output, raw or URL-encoded.
    seen = _secrets(result)
    for secret in (azurite.ACCOUNT_KEY, WRONG_KEY, FORGED_SIG):
        for form in (secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret)):
            assert form not in seen, f"a secret leaked in the output of {name}"


def test_there_are_at_least_fifty_cases() -> None:
    assert len(CASES) >= 50
    assert sum(1 for case in CASES.values() if case.code == 2) >= 35  # the option ranges
    assert sum(1 for case in CASES.values() if "reserved" in case.words) >= 7  # the tool's own names
