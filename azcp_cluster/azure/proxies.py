"""Which proxy a request goes through: ``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``. Pure code.

The same variables, read the same way, as the listing (azure-storage-blob over requests)
and azcopy: the lower-case name first, then the upper-case one; ``https://`` URLs take
``https_proxy``, ``http://`` URLs ``http_proxy``, either falls back to ``all_proxy``.
``no_proxy`` is a comma-separated list of host names (a suffix on a dot boundary, with or
without the leading dot or ``*.``), IP addresses, CIDR blocks, any of them with ``:port``, ``*``,
or ``:port`` alone (every host on that port; ``*:port`` too).
A proxy is an ``http://`` URL (the scheme may be left out), optionally with
``user:password@``, sent as ``Proxy-Authorization: Basic``.

Who refused: an answer of the storage service always carries ``x-ms-request-id`` (Azure's and
Azurite's, errors included); a 401, 403 or 407 without it, on a request that went through a
proxy (plain HTTP, or a TLS-inspecting proxy inside the tunnel), is the proxy's own, and the
message names the proxy instead of the storage credentials (:func:`proxy_refused`).
"""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from azcp_cluster.core.errors import UsageError

DEFAULT_PROXY_PORT = 80


@dataclass(frozen=True)
class Proxy:
    """A forward proxy: where to connect, what to show, how to authenticate."""

    host: str
    port: int
    authorization: str | None = field(repr=False)  # the Proxy-Authorization header's value, or None
    variable: str  # the environment variable it came from (for messages)
    url: str = field(repr=False, default="")  # as spelled, credentials included (for the listing's SDK)

    @property
    def shown(self) -> str:
        """The proxy as messages name it: never its credentials."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port} (from {self.variable})"


# What a proxy answers when it will not pass a request on (its authentication, or a policy);
# the storage service never sends 407.
REFUSALS = (401, 403, 407)


def from_storage(header_names: Iterable[str]) -> bool:
    """Whether a response with these header names came from the storage service (it always sends x-ms-request-id)."""
    return any(name.lower() == "x-ms-request-id" for name in header_names)


def proxy_refused(proxy: Proxy | None, status: int, header_names: Iterable[str]) -> bool:
    """Whether a response went through ``proxy`` and is the proxy's own refusal, not the service's."""
    if proxy is None or status not in REFUSALS:
        return False
    return status == 407 or not from_storage(header_names)


def refusal_message(proxy: Proxy, what: str, status: int, reason: str) -> str:
    """One line for ``proxy``'s refusal of ``what`` ("the listing", "the request")."""
    said = f"HTTP {status} {reason}".rstrip()
    if status == 407:
        return f"proxy {proxy.shown} refused {what}: {said}; check the credentials in the proxy URL"
    return (
        f"proxy {proxy.shown} refused {what}: {said} (its own answer: no x-ms-request-id); "
        "check that it lets the storage endpoint through, or exempt the endpoint with NO_PROXY"
    )


def _lookup(env: Mapping[str, str], name: str) -> tuple[str, str] | None:
    for variable in (name.lower(), name.upper()):
        value = env.get(variable, "").strip()
        if value:
            return variable, value
    return None


def parse_proxy(value: str, variable: str) -> Proxy:
    """The proxy that ``value`` (an environment variable's) names; a clear UsageError if it cannot be used."""
    spelled = value if "://" in value else "http://" + value
    parts = urlsplit(spelled)
    if parts.scheme.lower() != "http":
        raise UsageError(
            f"{variable}: only http:// proxies are supported (got a {parts.scheme}:// proxy); "
            "HTTPS to the storage account is tunnelled through it with CONNECT"
        )
    try:
        port = parts.port or DEFAULT_PROXY_PORT
    except ValueError:
        raise UsageError(f"{variable}: the proxy's port is not a number") from None
    if not parts.hostname:
        raise UsageError(f"{variable}: the proxy URL has no host")
    authorization = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
    return Proxy(parts.hostname, port, authorization, variable, spelled)


def bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether ``host:port`` is exempt from the proxy under ``no_proxy``."""
    host = host.lower().strip("[]").rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        name, want_port = entry, None
        if entry.startswith("["):  # [v6] or [v6]:port
            name, _, rest = entry[1:].partition("]")
            if rest.startswith(":") and rest[1:].isdigit():
                want_port = int(rest[1:])
        elif entry.count(":") == 1:  # name:port or v4:port (a bare v6 address has several)
            name, _, tail = entry.partition(":")
            if not tail.isdigit():
                continue
            want_port = int(tail)
        if want_port is not None and want_port != port:
            continue
        if want_port is not None and entry.startswith((":", "*:")):  # ":port", "*:port": any host on it
            return True
        if address is not None:
            try:
                if address in ipaddress.ip_network(name, strict=False):
                    return True
            except ValueError:
                pass
            continue
        name = name.removeprefix("*.").lstrip(".").rstrip(".")  # "*.example.com" as Go's reading has it
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


def proxy_for(url: str, env: Mapping[str, str]) -> Proxy | None:
    """The proxy a request for ``url`` goes through, or None (no variable set, or ``no_proxy`` exempts it)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    found = _lookup(env, f"{scheme}_proxy") or _lookup(env, "all_proxy")
    if found is None:
        return None
    host = parts.hostname or ""
    port = parts.port or (443 if scheme == "https" else 80)
    exempt = _lookup(env, "no_proxy")
    if exempt is not None and bypassed(host, port, exempt[1]):
        return None
    return parse_proxy(found[1], found[0])
