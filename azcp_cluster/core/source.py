"""Parse SOURCE arguments into a structured location. Pure code.

Two URL styles name a blob container and an optional prefix:

* virtual-host style: ``https://ACCOUNT.blob.core.windows.net/CONTAINER[/PREFIX][?SAS]``
  (any ``ACCOUNT.blob.<suffix>`` host, so sovereign clouds and Azure Stack work too, and
  ``ACCOUNT-secondary``, ``ACCOUNT.zNN.blob.storage.azure.net``, ``ACCOUNT.privatelink.blob...``);
* path style: ``http(s)://HOST[:PORT]/ACCOUNT/CONTAINER[/PREFIX][?SAS]`` for the emulator
  and custom endpoints.

Anything without a scheme is a local path (staged from a shared filesystem in a later mode).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote, urlsplit

from azcp_cluster.core.errors import UsageError

# Container names: 3-63 chars, lowercase letters, digits and single hyphens (Azure's rule),
# plus "$root"/"$web" style system containers.
# The Blob service REST version every request of the tool names (x-ms-version): the listing's
# and the ranged GETs'.
API_VERSION = "2023-11-03"
_CONTAINER_RE = re.compile(r"^(\$[a-z]+|[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62})$")
_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
# ACCOUNT[-secondary][.zNN|.privatelink].blob.SUFFIX: every cloud's suffix, the read-access
# secondary, DNS-zone endpoints (ACCOUNT.z01.blob.storage.azure.net) and private link names.
_VHOST_RE = re.compile(r"^([a-z0-9]{3,24})(?:-secondary)?(?:\.z[0-9]{2}|\.privatelink)?\.blob\.(.+)$")


@dataclass(frozen=True)
class BlobSource:
    """A container (and optional prefix) in a blob service."""

    endpoint: str  # service URL without a trailing slash, e.g. https://acct.blob.core.windows.net
    account: str
    container: str
    prefix: str  # as written after the container, without a leading slash; "" for all
    sas: str | None  # query string without "?", None when the URL has none

    @property
    def container_url(self) -> str:
        """URL of the container, without credentials."""
        return f"{self.endpoint}/{self.container}"

    def redacted(self) -> str:
        """The source as it may be printed: never the SAS signature."""
        text = self.container_url + (f"/{self.prefix}" if self.prefix else "")
        return text + ("?<SAS>" if self.sas else "")


def is_url(text: str) -> bool:
    """Whether SOURCE is written as a URL (has a scheme) rather than a local path."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text) is not None


def parse_blob_url(text: str) -> BlobSource:
    """Parse a blob container URL; raise :class:`UsageError` with a clear message if malformed.

    The message never repeats the query string, which may hold a SAS signature.
    """
    shown = text.split("?", 1)[0]
    parts, port = _url_parts(text, shown)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    segments = parts.path.split("/")[1:] if parts.path else []
    account, endpoint, segments = _account(scheme, host, _netloc(host, port), segments, shown)
    if not segments or not segments[0]:
        raise UsageError(f"malformed SOURCE URL {shown!r}: missing container name")
    container = unquote(segments[0])
    if not _CONTAINER_RE.match(container):
        raise UsageError(f"malformed SOURCE URL {shown!r}: {container!r} is not a valid container name")
    prefix = unquote("/".join(segments[1:]))
    sas = parts.query or None
    return BlobSource(endpoint=endpoint, account=account, container=container, prefix=prefix, sas=sas)


def _url_parts(text: str, shown: str) -> tuple[SplitResult, int | None]:
    """``text`` split, and its port: refused unless it is an http(s) URL with a host and no
    fragment (``shown``: the URL without its query, for the message)."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"malformed SOURCE URL {shown!r}: {exc}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise UsageError(f"unsupported scheme {parts.scheme!r} in SOURCE {shown!r} (use https:// or http://)")
    if not parts.hostname:
        raise UsageError(f"malformed SOURCE URL {shown!r}: no host")
    if parts.fragment:
        raise UsageError(f"malformed SOURCE URL {shown!r}: unexpected '#' fragment")
    return parts, port


def _netloc(host: str, port: int | None) -> str:
    """The host and port as an endpoint writes them: an IPv6 literal in brackets."""
    if ":" in host:  # IPv6 literal
        return f"[{host}]" if port is None else f"[{host}]:{port}"
    return host if port is None else f"{host}:{port}"


def _account(scheme: str, host: str, netloc: str, segments: list[str], shown: str) -> tuple[str, str, list[str]]:
    """The storage account, the endpoint and the path's segments after the account: from the host
    (virtual-host style, ``ACCOUNT.blob.SUFFIX``) or from the first segment (path style)."""
    vhost = _VHOST_RE.match(host)
    if vhost is None and ".blob." in host and not host.replace(".", "").isdigit():
        account = host.split(".blob.", 1)[0]
        raise UsageError(f"malformed SOURCE URL {shown!r}: {account!r} is not a storage account name")
    if vhost:
        return vhost.group(1), f"{scheme}://{netloc}", segments
    if not segments or not segments[0]:
        raise UsageError(
            f"malformed SOURCE URL {shown!r}: missing account (path-style URLs are "
            "http(s)://HOST:PORT/ACCOUNT/CONTAINER[/PREFIX])"
        )
    account = unquote(segments[0])
    if not _ACCOUNT_RE.match(account):
        raise UsageError(f"malformed SOURCE URL {shown!r}: {account!r} is not a storage account name")
    return account, f"{scheme}://{netloc}/{account}", segments[1:]
