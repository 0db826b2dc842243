"""Which credential a run uses, and how it signs listing calls and ranged GETs.

Resolution order (first match wins, as in the reference tool): a SAS in the URL;
``AZURE_STORAGE_CONNECTION_STRING``; ``AZURE_STORAGE_ACCOUNT`` + ``AZURE_STORAGE_KEY``;
``AZURE_STORAGE_SAS_TOKEN``; anonymous. Token credentials (azure-identity) plug in as one
more :class:`Authorizer` that adds an ``Authorization: Bearer`` header.

Secrets never appear in ``repr``, messages or reports.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from azcp_cluster.errors import UsageError
from azcp_cluster.source import BlobSource

# A SAS we mint from an account key lives this long; runs longer than this re-mint it.
MINTED_SAS_LIFETIME = _dt.timedelta(hours=12)


@dataclass(frozen=True)
class Credential:
    """A resolved credential. ``origin`` says where it came from, for messages."""

    kind: str  # "sas" | "shared_key" | "anonymous"
    origin: str
    account: str = ""
    sas: str = field(default="", repr=False)
    account_key: str = field(default="", repr=False)


def parse_connection_string(text: str) -> dict[str, str]:
    """Split an Azure Storage connection string into its ``Key=Value`` fields."""
    fields: dict[str, str] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UsageError("AZURE_STORAGE_CONNECTION_STRING is malformed (expected Key=Value;Key=Value)")
        fields[key.strip()] = value.strip()
    return fields


def resolve_credential(source: BlobSource, env: Mapping[str, str]) -> Credential:
    """Pick the credential for ``source`` from the URL and the environment (first match wins)."""
    if source.sas:
        return Credential(kind="sas", origin="SAS in the URL", account=source.account, sas=source.sas)
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if conn:
        fields = parse_connection_string(conn)
        sas = fields.get("SharedAccessSignature", "").lstrip("?")
        if sas:
            return Credential(kind="sas", origin="AZURE_STORAGE_CONNECTION_STRING", sas=sas)
        key = fields.get("AccountKey", "")
        account = fields.get("AccountName", "") or source.account
        if key:
            return Credential(
                kind="shared_key", origin="AZURE_STORAGE_CONNECTION_STRING", account=account, account_key=key
            )
        raise UsageError("AZURE_STORAGE_CONNECTION_STRING has neither AccountKey nor SharedAccessSignature")
    key = env.get("AZURE_STORAGE_KEY", "").strip()
    account = env.get("AZURE_STORAGE_ACCOUNT", "").strip()
    if key:
        return Credential(
            kind="shared_key",
            origin="AZURE_STORAGE_ACCOUNT/AZURE_STORAGE_KEY",
            account=account or source.account,
            account_key=key,
        )
    sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?")
    if sas:
        return Credential(kind="sas", origin="AZURE_STORAGE_SAS_TOKEN", sas=sas)
    return Credential(kind="anonymous", origin="anonymous access")


class Authorizer:
    """Signs requests to one container: a query string to append and headers to add."""

    def __init__(
        self,
        source: BlobSource,
        credential: Credential,
        clock: Callable[[], float],
    ) -> None:
        self.source = source
        self.credential = credential
        self._clock = clock
        self._query = ""
        self._query_expires = 0.0

    def sdk_credential(self) -> Any:
        """The credential object azure-storage-blob accepts for listing calls."""
        cred = self.credential
        if cred.kind == "shared_key":
            from azure.core.credentials import AzureNamedKeyCredential

            return AzureNamedKeyCredential(cred.account, cred.account_key)
        if cred.kind == "sas":
            return cred.sas
        return None

    def query(self) -> str:
        """Query string (without ``?``) that authorizes a GET of a blob in the container."""
        cred = self.credential
        if cred.kind == "sas":
            return cred.sas
        if cred.kind != "shared_key":
            return ""
        now = self._clock()
        if now >= self._query_expires:
            self._query = self._mint_sas(now)
            # Re-mint well before expiry so a request never carries a stale signature.
            self._query_expires = now + MINTED_SAS_LIFETIME.total_seconds() / 2
        return self._query

    def headers(self) -> dict[str, str]:
        """Headers that authorize a request (a bearer token for token credentials)."""
        return {}

    def blob_url(self, name: str) -> str:
        """Fully encoded URL of blob ``name``, with its authorization query string."""
        url = f"{self.source.container_url}/{quote(name, safe='/~')}"
        query = self.query()
        return f"{url}?{query}" if query else url

    def _mint_sas(self, now: float) -> str:
        # A read-only, container-scoped SAS computed locally from the key: one HMAC per
        # run instead of a Shared Key signature per request.
        from azure.storage.blob import ContainerSasPermissions, generate_container_sas

        start = _dt.datetime.fromtimestamp(now, tz=_dt.timezone.utc) - _dt.timedelta(minutes=15)
        try:
            return str(
                generate_container_sas(
                    account_name=self.credential.account,
                    container_name=self.source.container,
                    account_key=self.credential.account_key,
                    permission=ContainerSasPermissions(read=True),
                    start=start,
                    expiry=start + MINTED_SAS_LIFETIME,
                )
            )
        except Exception as exc:  # a key that is not base64, for example
            raise UsageError(
                f"cannot use the account key from {self.credential.origin}: {type(exc).__name__}"
            ) from None
