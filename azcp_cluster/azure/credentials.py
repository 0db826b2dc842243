"""Which credential a run uses, and how it signs listing calls and ranged GETs.

Resolution order (first match wins, as in the reference tool): a SAS in the URL;
``AZURE_STORAGE_CONNECTION_STRING``; ``AZURE_STORAGE_ACCOUNT`` + ``AZURE_STORAGE_KEY``;
``AZURE_STORAGE_SAS_TOKEN``; a token credential from azure-identity when the environment
names one (workload identity, managed identity, Azure CLI: see :mod:`azcp_cluster.azure.identity`);
anonymous. ``--auth METHOD`` (or ``AZCP_AUTH``) forces one method; the Python API's
``credential=`` (a ``TokenCredential`` or a SAS) comes before all of them.

Token credentials sign with an ``Authorization: Bearer`` header (:mod:`azcp_cluster.azure.tokens`)
and only over https. Secrets never appear in ``repr``, messages or reports.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import hashlib
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from azcp_cluster.azure import identity
from azcp_cluster.azure.tokens import SdkTokenCredential, TokenCache
from azcp_cluster.core.config import AUTH_METHODS
from azcp_cluster.core.errors import CredentialError, UsageError
from azcp_cluster.core.source import BlobSource

# A SAS we mint from an account key lives this long; runs longer than this re-mint it.
MINTED_SAS_LIFETIME = _dt.timedelta(hours=12)
# The service version of the SASs minted from a key (the string to sign is that of 2020-12-06 on).
SAS_VERSION = "2026-02-06"


@dataclass(frozen=True)
class Credential:
    """A resolved credential. ``origin`` says where it came from, for messages."""

    kind: str  # "sas" | "shared_key" | "token" | "anonymous"
    origin: str
    account: str = ""
    sas: str = field(default="", repr=False)
    account_key: str = field(default="", repr=False)
    # kind "token": an azure-core TokenCredential (get_token(*scopes) -> AccessToken).
    token_credential: Any = field(default=None, repr=False, compare=False)


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


def _from_url(source: BlobSource, env: Mapping[str, str]) -> Credential | None:
    if source.sas:
        return Credential(kind="sas", origin="SAS in the URL", account=source.account, sas=source.sas)
    return None


def _from_connection_string(source: BlobSource, env: Mapping[str, str]) -> Credential | None:
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if not conn:
        return None
    fields = parse_connection_string(conn)
    sas = fields.get("SharedAccessSignature", "").lstrip("?")
    if sas:
        return Credential(kind="sas", origin="AZURE_STORAGE_CONNECTION_STRING", sas=sas)
    key = fields.get("AccountKey", "")
    account = fields.get("AccountName", "") or source.account
    if key:
        return Credential(kind="shared_key", origin="AZURE_STORAGE_CONNECTION_STRING", account=account, account_key=key)
    raise UsageError("AZURE_STORAGE_CONNECTION_STRING has neither AccountKey nor SharedAccessSignature")


def _from_key(source: BlobSource, env: Mapping[str, str]) -> Credential | None:
    key = env.get("AZURE_STORAGE_KEY", "").strip()
    if not key:
        return None
    account = env.get("AZURE_STORAGE_ACCOUNT", "").strip()
    return Credential(
        kind="shared_key",
        origin="AZURE_STORAGE_ACCOUNT/AZURE_STORAGE_KEY",
        account=account or source.account,
        account_key=key,
    )


def _from_sas_token(source: BlobSource, env: Mapping[str, str]) -> Credential | None:
    sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?")
    return Credential(kind="sas", origin="AZURE_STORAGE_SAS_TOKEN", sas=sas) if sas else None


# The methods that come before token credentials, in order, and what each needs when forced.
_STATIC: dict[str, tuple[Callable[[BlobSource, Mapping[str, str]], Credential | None], str]] = {
    "sas": (_from_url, "a SAS in the SOURCE URL (...?sv=...&sig=...)"),
    "connection-string": (_from_connection_string, "AZURE_STORAGE_CONNECTION_STRING"),
    "key": (_from_key, "AZURE_STORAGE_KEY (and AZURE_STORAGE_ACCOUNT, or the account in the URL)"),
    "sas-token": (_from_sas_token, "AZURE_STORAGE_SAS_TOKEN"),
}

ANONYMOUS = Credential(kind="anonymous", origin="anonymous access")

# The Azure role an identity needs to list a container and read its blobs with a token.
READER_ROLE = "Storage Blob Data Reader"
# Codes of a refusal that may be the account's network rules, whatever the credential.
_NETWORK_RULES = frozenset({"AuthorizationFailure", "AuthorizationSourceIPMismatch"})


def denied(status: int, code: str, credential: Credential) -> str:
    """A 401 or 403 in words, with what to do: with no credential, what to set; with one, which
    one was refused and what it needs. Never a secret: the credential's origin and account only."""
    said = f"access denied (HTTP {status}, {code})"
    if credential.kind == "anonymous":
        return (
            f"{said}; no credential was sent (anonymous access): set a SAS with read and list (sp=rl) in the "
            "URL (...?sv=...&sig=...) or in AZURE_STORAGE_SAS_TOKEN, or AZURE_STORAGE_CONNECTION_STRING; "
            "for an https:// URL (tokens are never sent over http), also `az login`, "
            "or on an Azure VM --auth managed-identity"
        )
    if credential.kind == "token":
        needs = f"its identity needs the role {READER_ROLE} on the account or the container"
    elif credential.kind == "sas":
        needs = (
            "a SAS needs read and list permissions (sp=rl), a validity that includes now "
            "and a signature by this account's key"
        )
    else:
        needs = f"it must be a key of account '{credential.account}'"
    if code in _NETWORK_RULES:
        needs += "; or the account's network rules (firewall) refuse this machine"
    return f"{said}; credential used: {credential.origin}; {needs} (--auth selects another)"


def _token(method: str, env: Mapping[str, str]) -> Credential:
    return Credential(kind="token", origin=identity.ORIGINS[method], token_credential=identity.build(method, env))


def _explicit(source: BlobSource, credential: Any) -> Credential:
    """The Python API's ``credential=``: a SAS string or an azure-core credential object."""
    if isinstance(credential, str):
        sas = credential.strip().lstrip("?")
        if not sas:
            raise CredentialError("credential= is an empty SAS")
        return Credential(kind="sas", origin="credential= (SAS)", account=source.account, sas=sas)
    origin = f"credential= ({type(credential).__name__})"
    if callable(getattr(credential, "get_token", None)):
        return Credential(kind="token", origin=origin, token_credential=credential)
    named = getattr(credential, "named_key", None)  # AzureNamedKeyCredential
    if named is not None:
        return Credential(kind="shared_key", origin=origin, account=named.name, account_key=named.key)
    signature = getattr(credential, "signature", None)  # AzureSasCredential
    if isinstance(signature, str) and signature.strip("? "):
        return Credential(kind="sas", origin=origin, account=source.account, sas=signature.strip().lstrip("?"))
    raise CredentialError(
        "credential= must be a SAS string or a TokenCredential (an object with get_token), "
        f"not {type(credential).__name__}"
    )


def chosen_method(method: str, env: Mapping[str, str]) -> tuple[str, str]:
    """``method`` (``--auth``), or ``AZCP_AUTH`` from ``env`` when it is ``auto``; validated.

    Returns the method and how to name its choice in messages (``--auth key``, ``AZCP_AUTH=key``).
    """
    if method == "auto":
        method = env.get("AZCP_AUTH", "").strip() or "auto"
        if method not in AUTH_METHODS:
            raise CredentialError(f"AZCP_AUTH must be one of {', '.join(AUTH_METHODS)}, not {method!r}")
        return method, f"AZCP_AUTH={method}"
    if method not in AUTH_METHODS:
        raise CredentialError(f"--auth must be one of {', '.join(AUTH_METHODS)}, not {method!r}")
    return method, f"--auth {method}"


def resolve_credential(
    source: BlobSource,
    env: Mapping[str, str],
    method: str = "auto",
    explicit: Any = None,
    *,
    cli_ready: Callable[[Mapping[str, str]], bool] | None = None,
) -> Credential:
    """Pick the credential for ``source``: ``explicit``, else ``method`` forced, else the first match.

    ``method`` is ``--auth`` (one of :data:`~azcp_cluster.core.config.AUTH_METHODS`). A forced
    method whose inputs are missing, or a token credential for an ``http://`` endpoint,
    raises :class:`CredentialError` (exit 2). No network call is made here: tokens are
    obtained on first use, by the ranks that need them. ``cli_ready`` is for tests (see
    :func:`azcp_cluster.azure.identity.automatic_method`).
    """
    if explicit is not None:
        if method != "auto":
            raise CredentialError(f"credential= and auth={method!r} cannot be combined; pass one of them")
        cred = _explicit(source, explicit)
    else:
        method, label = chosen_method(method, env)
        if method in identity.TOKEN_METHODS:
            _require_https(source, identity.ORIGINS[method])
        cred = _by_method(source, env, method, label, cli_ready)
    if cred.kind == "token":
        _require_https(source, cred.origin)
    return cred


def _require_https(source: BlobSource, origin: str) -> None:
    if not source.endpoint.startswith("https://"):
        raise CredentialError(
            f"{origin} gives bearer tokens, which are only sent over https; {source.endpoint} is http"
        )


def _by_method(
    source: BlobSource,
    env: Mapping[str, str],
    method: str,
    label: str,
    cli_ready: Callable[[Mapping[str, str]], bool] | None,
) -> Credential:
    if method == "anonymous":
        return ANONYMOUS
    if method in _STATIC:
        find, needs = _STATIC[method]
        found = find(source, env)
        if found is None:
            raise CredentialError(f"{label} needs {needs}")
        return found
    if method in identity.TOKEN_METHODS:
        identity.check_inputs(method, env, label)
        return _token(method, env)
    for find, _ in _STATIC.values():  # auto: first match wins
        found = find(source, env)
        if found is not None:
            return found
    # Bearer tokens need https: over http (the emulator) the order goes on to anonymous.
    if source.endpoint.startswith("https://"):
        auto = identity.automatic_method(env, cli_ready=cli_ready)
        if auto is not None:
            return _token(auto, env)
    return ANONYMOUS


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
        self._list_query = ""  # a shared key's listing SAS (read and list), minted on first use
        self._list_expires = 0.0
        # Token credentials: one cache per rank, filled on first use (listing or download).
        self.tokens: TokenCache | None = None
        if credential.kind == "token":
            self.tokens = TokenCache(credential.token_credential, credential.origin, clock)

    def sdk_credential(self) -> Any:
        """The credential object azure-storage-blob accepts for listing calls."""
        cred = self.credential
        if cred.kind == "shared_key":
            from azure.core.credentials import AzureNamedKeyCredential

            return AzureNamedKeyCredential(cred.account, cred.account_key)
        if cred.kind == "sas":
            return cred.sas
        if self.tokens is not None:
            # The same cache as the downloads: one token per rank, refreshed in one place.
            return SdkTokenCredential(self.tokens)
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

    def list_query(self) -> str:
        """Query string (without ``?``) that authorizes List Blobs on the container: the SAS
        given, or one minted from the account key with the list permission as well."""
        cred = self.credential
        if cred.kind != "shared_key":
            return self.query()
        now = self._clock()
        if now >= self._list_expires:
            self._list_query = self._mint_sas(now, listing=True)
            self._list_expires = now + MINTED_SAS_LIFETIME.total_seconds() / 2
        return self._list_query

    def headers(self) -> dict[str, str]:
        """Headers that authorize a request: ``Authorization: Bearer`` for token credentials.

        The token is obtained on the first call and refreshed when due (see
        :func:`azcp_cluster.azure.tokens.refresh_time`); a credential that yields none raises
        :class:`CredentialError`.
        """
        if self.tokens is None:
            return {}
        return self.tokens.header()

    def blob_url(self, name: str) -> str:
        """Fully encoded URL of blob ``name``, with its authorization query string."""
        url = f"{self.source.container_url}/{quote(name, safe='/~')}"
        query = self.query()
        return f"{url}?{query}" if query else url

    def _mint_sas(self, now: float, listing: bool = False) -> str:
        # A read-only (and, for the listing, list), container-scoped SAS computed locally
        # from the key: one HMAC per run instead of a Shared Key signature per request.
        start = _dt.datetime.fromtimestamp(now, tz=_dt.timezone.utc) - _dt.timedelta(minutes=15)
        try:
            return container_sas(
                self.credential.account,
                self.source.container,
                self.credential.account_key,
                "rl" if listing else "r",
                start,
                start + MINTED_SAS_LIFETIME,
            )
        except (binascii.Error, ValueError):  # not base64, or not even ASCII
            raise UsageError(f"cannot use the account key from {self.credential.origin}: it is not base64") from None


def container_sas(
    account: str,
    container: str,
    key: str,
    permissions: str,
    start: _dt.datetime,
    expiry: _dt.datetime,
    version: str = SAS_VERSION,
) -> str:
    """A service SAS for ``container`` signed with the account ``key`` (base64), as
    azure-storage-blob's ``generate_container_sas`` makes it (the same string, for the same
    version): the fields of the string to sign, in their order, most of them empty here.
    Made here because importing the SDK for it costs a small listing a fifth of a second."""
    stamp = "%Y-%m-%dT%H:%M:%SZ"
    st, se = start.strftime(stamp), expiry.strftime(stamp)
    # sp, st, se, resource, si, sip, spr, sv, sr, snapshot time, ses, rscc, rscd, rsce, rscl, rsct
    fields = [permissions, st, se, f"/blob/{account}/{container}", "", "", "", version, "c", "", "", "", "", "", "", ""]
    digest = hmac.new(base64.b64decode(key), "\n".join(fields).encode(), hashlib.sha256).digest()
    signature = base64.b64encode(digest).decode()
    query = {"st": st, "se": se, "sp": permissions, "sv": version, "sr": "c", "sig": signature}
    return "&".join(f"{name}={quote(value, safe='/')}" for name, value in query.items())  # as the SDK quotes
