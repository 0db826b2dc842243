"""A connection that could not be made, in plain words, for the listing's and the GETs' lines.

The one place that reads connection failures, whatever library raised them (asyncio's
sockets, aiohttp, the Azure SDK, http.client): "connection refused", "name not resolved",
"timed out", "TLS: <reason>", with the ``host:port`` the line names.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from urllib.parse import urlsplit


def network_cause(exc: BaseException) -> str | None:
    """A connection failure in plain words: "connection refused", "name not resolved", "timed
    out", "TLS: <reason>", "connection reset", or the system's own words; None if ``exc`` and
    its causes are no network failure.

    The one place that reads them, whatever library raised (asyncio's sockets, aiohttp's
    ClientConnectorError, the Azure SDK's ServiceRequestError, http.client): it follows the
    chain of causes. Never an exception's whole text, which may carry a URL and its SAS.
    """
    found: str | None = None
    for current in _chain(exc):
        if isinstance(current, ssl.SSLCertVerificationError):
            return f"TLS: {current.verify_message or 'certificate verify failed'}"
        if isinstance(current, ssl.SSLError):
            reason = getattr(current, "reason", None) or "handshake failed"
            return f"TLS: {str(reason).lower().replace('_', ' ')}"
        if isinstance(current, socket.gaierror):
            return "name not resolved"
        if isinstance(current, ConnectionRefusedError):
            return "connection refused"
        if isinstance(current, ConnectionResetError):
            return "connection reset"
        if isinstance(current, TimeoutError | asyncio.TimeoutError | socket.timeout):
            return "timed out"
        if type(current).__name__ in ("ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError"):
            return "timed out"  # aiohttp's
        if found is None and isinstance(current, OSError) and current.strerror and not current.filename:
            found = current.strerror.lower()  # e.g. "network is unreachable"
    return found


def host_port(url: str) -> str:
    """``host:port`` of a URL, the scheme's port when none is written (for a line naming where)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# getaddrinfo's answers that a second try may change: the resolver could not be asked
# (EAI_AGAIN: a DNS server overloaded by a thousand nodes resolving at once). A name the
# resolver says does not exist (EAI_NONAME) stays so.
_NAME_MAY_COME = frozenset({getattr(socket, "EAI_AGAIN", -3)})
# TLS failures that are a connection cut during the handshake, not a disagreement about TLS.
_TLS_CUT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)
# OpenSSL's reasons for a first answer that is no TLS record: a plain-HTTP port.
_NOT_TLS = ("wrong version number", "packet length too long", "record layer failure", "http request")


def hopeless(exc: BaseException) -> bool:
    """Whether a failure to connect is one that asking again at once will not mend: refused
    (nothing listens), a name that does not exist, TLS that the two ends cannot agree on
    (a plain-HTTP port, a certificate not trusted). Read through the chain of causes, as
    :func:`network_cause`. Timeouts and resets are not: they come and go."""
    for current in _chain(exc):
        if isinstance(current, ConnectionRefusedError):
            return True
        if isinstance(current, socket.gaierror):
            return current.errno not in _NAME_MAY_COME
        if isinstance(current, ssl.SSLError):
            return not isinstance(current, _TLS_CUT)
    return False


def tls_hint(cause: str) -> str:
    """What to try for a TLS ``cause`` (of :func:`network_cause`) that says the port speaks no TLS."""
    return " (a plain-HTTP port? then use http://)" if cause.startswith("TLS: ") and cause[5:] in _NOT_TLS else ""


def speaks_tls(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a TLS handshake with ``host:port`` completes (its certificate not checked): asked
    where a plain-HTTP request was answered by a closed connection, which is what a TLS port
    does with one."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock, context.wrap_socket(sock):
            return True
    except (OSError, ValueError):
        return False


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it links to (causes, contexts, arguments, libraries' wrapped ones)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    found: list[BaseException] = []
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        linked = [current.__cause__, current.__context__, *getattr(current, "args", ())]
        linked += [getattr(current, name, None) for name in ("inner_exception", "os_error", "reason")]
        todo += [other for other in linked if isinstance(other, BaseException)]
    return found
