"""Stage with ``azcp_cluster.stage(..., credential=...)`` and a test TokenCredential.

Usage: stage_with_token.py URL DEST OUT_DIR MODE

The credential issues unsigned JWTs of the kind Azurite's ``--oauth basic`` accepts (it
checks ``aud``, ``iss``, ``nbf``/``iat``/``exp``, not the signature). Their ``exp`` is an hour
away, but the first token a rank gets *tells* the client it expires 2 ms after issue, so
the client refreshes it before its next request: a rank that sends several requests asks
exactly twice (the second token says an hour).

MODE ``good``: every token is valid; ``workers``: the same, each rank's GETs on two download
worker processes (their tokens come from the rank). MODE ``bad-download-token``: rank 0's tokens (it lists
and downloads) are valid; the other ranks' have a wrong audience, so only their ranged GETs
are refused. MODE ``unavailable``: the other ranks' credential raises, as azure-identity's
do, with a long message of several lines. Writes OUT_DIR/rank-N.json: the outcome, how many tokens were
issued, the tokens themselves (for the test to look for them in the output) and the scopes.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

from mpi4py import MPI

import azcp_cluster

GOOD_AUDIENCE = "https://storage.azure.com"
ISSUER = "https://sts.windows.net/72f988bf-0000-0000-0000-000000000000/"
FIRST_LIFETIME = 0.002  # seconds, as the client sees it: a refresh is due at once


def _b64(doc: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


class TestCredential:
    """A TokenCredential that mints JWTs locally and remembers what it issued."""

    def __init__(self, rank: int, mode: str) -> None:
        self.rank = rank
        self.mode = mode
        self.tokens: list[str] = []
        self.scopes: list[list[str]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        self.scopes.append(list(scopes))
        if self.mode == "unavailable" and self.rank != 0:
            from azure.identity import CredentialUnavailableError

            raise CredentialUnavailableError(
                "ManagedIdentityCredential authentication unavailable. No identity has been assigned to this "
                "resource.\nError details: see https://aka.ms/azsdk/python/identity/managedidentitycredential/troubleshoot"
            )
        now = int(time.time())
        good = self.mode in ("good", "workers") or self.rank == 0
        claims = {
            "aud": GOOD_AUDIENCE if good else "https://vault.azure.net",
            "iss": ISSUER,
            "iat": now - 60,
            "nbf": now - 60,
            "exp": now + 3600,
            "oid": f"rank-{self.rank}-token-{len(self.tokens)}",
        }
        token = f"{_b64({'alg': 'RS256', 'typ': 'JWT'})}.{_b64(claims)}.c2lnbmF0dXJl"
        lifetime = FIRST_LIFETIME if not self.tokens else 3600
        self.tokens.append(token)
        return AccessToken(token, time.time() + lifetime)  # a float: sub-second lifetimes


url, dest, out_dir, mode = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
credential = TestCredential(rank, mode)
try:
    report = azcp_cluster.stage(
        url,
        dest,
        credential=credential,
        quiet=rank != 0,
        progress=False,
        block_size="64KiB",  # the smallest --block-size: several GETs per rank
        shard_size="128KiB",
        concurrency=2,
        bcast_chunk="1MiB",
        verify=True,
        download_workers=2 if mode == "workers" else 1,
    )
    outcome: dict[str, Any] = {
        "ok": True,
        "files": report.files,
        "downloaded": report.downloaded_bytes,
        "workers": report.worker_bytes_by_rank,
    }
except azcp_cluster.AzcpError as exc:
    outcome = {"ok": False, "type": type(exc).__name__, "code": exc.exit_code, "line": exc.one_line()}
record = {"rank": rank, "issued": len(credential.tokens), "tokens": credential.tokens, "scopes": credential.scopes}
(out_dir / f"rank-{rank}.json").write_text(json.dumps({**record, **outcome}))
