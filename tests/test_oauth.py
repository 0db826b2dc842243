"""Bearer tokens for real: the emulator over HTTPS with its OAuth mode, under `mpiexec -n 4`.

The test makes its own certificate (cryptography, a dependency of azure-identity) for
127.0.0.1, serves the emulator with it and ``--oauth basic``, and points ``SSL_CERT_FILE`` and
``REQUESTS_CA_BUNDLE`` at it, so the listing (requests) and the ranged GETs (http1, over asyncio TLS) both
trust it. The container is private: a request without a valid token is refused.

* the Python API with a test TokenCredential (tests/programs/stage_with_token.py): every
  rank gets tokens, refreshes one that is about to expire, and the copies are exact; tokens
  with the wrong audience on the downloading ranks make the downloads fail with one line and
  exit code 5, a credential that raises there gives exit code 2;
* the command line with ``--auth azure-cli`` and a stand-in ``az`` that prints tokens, so
  azure-identity's own AzureCliCredential runs; ``--auth anonymous`` is refused (exit 3);
  ``--auth workload-identity`` without its variables, and a token credential for an http://
  SOURCE, exit 2 with one line;
* no token ever appears in what the runs print.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.certs import make_certificate
from tests.conftest import MPI_TIMEOUT, REPO, clean_env, mpiexec_path, run_cli, tree_of

PROGRAM = REPO / "tests" / "programs" / "stage_with_token.py"
CONTAINER = "secure"
PREFIX = "model"
Secure = tuple[azurite.Emulator, dict[str, bytes]]  # the emulator and what it holds


def _dataset() -> dict[str, bytes]:
    blobs = {f"{PREFIX}/shard-{i}.bin": os.urandom(96 * 1024 + 7 * i) for i in range(6)}
    blobs[f"{PREFIX}/big.bin"] = os.urandom(700 * 1024)  # split into shards of several ranks
    blobs[f"{PREFIX}/config.json"] = b'{"layers": 2}'
    return blobs


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    """An HTTPS emulator with OAuth, holding a private container uploaded with the account key."""
    cert, key = make_certificate(tmp_path_factory.mktemp("tls"))
    blobs = _dataset()
    with azurite.running(cert=str(cert), key=str(key), oauth="basic") as emu:
        azurite.upload(emu, CONTAINER, blobs)
        yield emu, blobs


def tls_env(emu: azurite.Emulator, **extra: str) -> dict[str, str]:
    assert emu.ca_file is not None
    return {"SSL_CERT_FILE": emu.ca_file, "REQUESTS_CA_BUNDLE": emu.ca_file, **extra}


def expected(blobs: dict[str, bytes]) -> dict[str, bytes]:
    return {name.removeprefix(f"{PREFIX}/"): data for name, data in blobs.items()}


def run_program(emu: azurite.Emulator, dest: str, out: Path, mode: str) -> tuple[list[dict[str, Any]], str]:
    out.mkdir()
    proc = subprocess.run(
        [mpiexec_path(), "-n", "4", sys.executable, str(PROGRAM), emu.url(CONTAINER, PREFIX), dest, str(out), mode],
        env=clean_env(tls_env(emu)),
        capture_output=True,
        text=True,
        timeout=MPI_TIMEOUT,
    )
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(4)], printed


def test_stage_with_a_token_credential_over_https(secure: Secure, tmp_path: Path) -> None:
    emu, blobs = secure
    lines, printed = run_program(emu, str(tmp_path / "node{rank}"), tmp_path / "out", "good")
    assert all(d["ok"] for d in lines), lines
    assert lines[0]["files"] == len(blobs) and lines[0]["downloaded"] == sum(map(len, blobs.values()))
    for rank in range(4):
        assert tree_of(tmp_path / f"node{rank}") == expected(blobs)
    # Every rank downloaded, so every rank asked for a token; the first one said it expired
    # 2 ms after issue, so each rank refreshed it once, before a later request.
    assert [d["issued"] for d in lines] == [2, 2, 2, 2], lines
    assert all(scopes == ["https://storage.azure.com/.default"] for d in lines for scopes in d["scopes"])
    assert "[list] 8 files" in printed
    for token in (t for d in lines for t in d["tokens"]):
        assert token not in printed and token.split(".")[1] not in printed


def test_download_workers_take_their_tokens_from_the_rank(secure: Secure, tmp_path: Path) -> None:
    """One token cache per rank: its worker processes never ask the credential (no token storm)."""
    emu, blobs = secure
    lines, printed = run_program(emu, str(tmp_path / "node{rank}"), tmp_path / "out", "workers")
    assert all(d["ok"] for d in lines), lines
    for rank in range(4):
        assert tree_of(tmp_path / f"node{rank}") == expected(blobs)
    per_rank = lines[0]["workers"]
    assert len(per_rank) == 4 and all(len(w) == 2 and all(b > 0 for b in w) for w in per_rank), per_rank
    # As without workers: the first token (said to expire at once) and its refresh, per rank.
    assert [d["issued"] for d in lines] == [2, 2, 2, 2], lines
    for token in (t for d in lines for t in d["tokens"]):
        assert token not in printed


@pytest.mark.parametrize(
    ("mode", "error", "code", "cause"),
    [
        # The emulator refuses the token: only the bearer header of the GETs can cause it.
        (
            "bad-download-token",
            "DownloadError",
            5,
            "access denied (HTTP 403, AuthenticationFailed); credential used: credential= (TestCredential); "
            "its identity needs the role Storage Blob Data Reader on the account or the container "
            "(--auth selects another)",
        ),
        # The credential yields no token: a credentials error, the first line of its message.
        (
            "unavailable",
            "CredentialError",
            2,
            "cannot get a token from credential= (TestCredential): CredentialUnavailableError: "
            "ManagedIdentityCredential authentication unavailable. No identity has been assigned to this resource.",
        ),
    ],
)
def test_a_token_refused_or_missing_on_the_downloading_ranks_fails_cleanly(
    secure: Secure, tmp_path: Path, mode: str, error: str, code: int, cause: str
) -> None:
    # Rank 0 lists (and downloads) with good tokens; the other ranks' tokens are refused, or
    # their credential raises, so only the downloads of ranks 1-3 fail.
    emu, _ = secure
    lines, printed = run_program(emu, str(tmp_path / "node{rank}"), tmp_path / "out", mode)
    assert all(not d["ok"] for d in lines), lines
    assert {(d["type"], d["code"]) for d in lines} == {(error, code)}
    line = lines[0]["line"]
    assert len({d["line"] for d in lines}) == 1 and "\n" not in line
    stage = "download" if code == 5 else "credentials"
    assert line.startswith(f"azcp-cluster: error [{stage}]: rank 1: "), line
    assert line.endswith(cause), line
    assert lines[0]["issued"] >= 1 and all(d["scopes"] for d in lines), lines
    for token in (t for d in lines for t in d["tokens"]):
        assert token not in printed and token not in line
    assert not any((tmp_path / f"node{rank}" / "config.json").exists() for rank in range(4))


FAKE_AZ = """\
#!{python}
# Stands in for `az account get-access-token --output json --resource R`: prints a token
# the emulator accepts and counts the calls.
import base64, json, sys, time
with open({log!r}, "a") as fh:
    fh.write(" ".join(sys.argv[1:]) + "\\n")
now = int(time.time())
def b64(doc):
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()
claims = {{"aud": "https://storage.azure.com", "iss": "https://sts.windows.net/t/", "iat": now - 60,
          "nbf": now - 60, "exp": now + 3600}}
token = b64({{"alg": "RS256", "typ": "JWT"}}) + "." + b64(claims) + ".c2ln"
print(json.dumps({{"accessToken": token, "expires_on": now + 3600, "tokenType": "Bearer"}}))
"""


def test_cli_with_auth_azure_cli(secure: Secure, tmp_path: Path) -> None:
    emu, blobs = secure
    bin_dir, log = tmp_path / "bin", tmp_path / "az-calls.log"
    bin_dir.mkdir()
    fake = bin_dir / "az"
    fake.write_text(FAKE_AZ.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    env = tls_env(emu, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    url = emu.url(CONTAINER, PREFIX)
    result = run_cli(
        [url, str(tmp_path / "node{rank}"), "--auth", "azure-cli", "--block-size", "64KiB", "--shard-size", "256KiB"],
        env=env,
        json_path=tmp_path / "report.json",
    )
    assert result.returncode == 0, result.output
    assert result.json is not None and result.json["files"] == len(blobs)
    for rank in range(4):
        assert tree_of(tmp_path / f"node{rank}") == expected(blobs)
    calls = log.read_text().splitlines()
    assert len(calls) == 4, calls  # one token per rank: rank 0 lists and downloads with one
    assert all(
        c.startswith("account get-access-token --output json --resource https://storage.azure.com") for c in calls
    )
    assert "accessToken" not in result.output and "eyJ" not in result.output

    # The same URL without a credential: refused, and the hint names what was used.
    denied = run_cli([url, str(tmp_path / "anon{rank}"), "--auth", "anonymous"], env=env, n=2)
    assert denied.returncode == 3, denied.output
    assert "access denied (HTTP 403" in denied.stderr and "no credential was sent (anonymous access)" in denied.stderr


def test_cli_forced_method_without_its_inputs_is_a_usage_error(secure: Secure, tmp_path: Path) -> None:
    emu, _ = secure
    result = run_cli(
        [emu.url(CONTAINER, PREFIX), str(tmp_path / "d{rank}"), "--auth", "workload-identity"],
        env=tls_env(emu, AZURE_CLIENT_ID="00000000-0000-0000-0000-000000000001"),
        n=2,
    )
    assert result.returncode == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "azcp-cluster: error [credentials]: rank 0: --auth workload-identity needs AZURE_TENANT_ID, "
        "AZURE_FEDERATED_TOKEN_FILE in the environment"
    ], result.stderr


def test_bearer_tokens_are_never_sent_over_http(emulator: azurite.Emulator, tmp_path: Path) -> None:
    result = run_cli([emulator.url("anything"), str(tmp_path / "d"), "--auth", "managed-identity"], n=0)
    assert result.returncode == 2, result.output
    assert "which are only sent over https" in result.stderr and len(result.stderr.splitlines()) == 1
