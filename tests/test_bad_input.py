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

from azcp_cluster.devtools import azurite
from azcp_cluster.naming import MAX_SEGMENT_BYTES
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
    "zero-chunk": Case(_url(), 2, "--bcast-chunk must be greater than zero", args=["--bcast-chunk", "0"]),
    "negative-block": Case(_url(), 2, "--block-size", args=["--block-size", "-1"]),
    "zero-concurrency": Case(_url(), 2, "--concurrency must be greater than zero", args=["--concurrency", "0"]),
    "zero-bandwidth": Case(_url(), 2, "--max-bandwidth", args=["--max-bandwidth", "0"]),
    "bad-size-unit": Case(_url(), 2, "invalid size unit", args=["--shard-size", "3parsecs"]),
    "unknown-option": Case(_url(), 2, "unrecognized arguments: --frobnicate", args=["--frobnicate"]),
    "beyond-memory": Case(_url(), 2, "available", args=["--bcast-chunk", "1TiB", "--bcast-pipeline", "8"]),
    "bad-compare": Case(_url(), 2, "--compare", args=["--compare", "sha1"]),
    "empty-prefix": Case(_url("nothing-here"), 0, "matched no files", warning=True),
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
    result = run_cli(
        [case.source(emulator, container), dest, *case.args],
        env=case.env(emulator),
        json_path=tmp_path / "report.json",
        n=2,
        cwd=work,
    )
    assert result.returncode == case.code, result.output
    assert "Traceback" not in result.output
    kind = "warning" if case.warning else "error"
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"azcp-cluster: {kind}")]
    assert len(lines) == 1, result.stderr
    assert case.words in lines[0], lines[0]
    if not case.warning:
        assert "azcp-cluster: error" not in result.stdout
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


def test_there_are_at_least_fifteen_cases() -> None:
    assert len(CASES) >= 15
