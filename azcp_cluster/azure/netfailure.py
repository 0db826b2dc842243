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
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    found: str | None = None
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
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
        linked = [current.__cause__, current.__context__, *getattr(current, "args", ())]
        linked += [getattr(current, name, None) for name in ("inner_exception", "os_error", "reason")]
        todo += [other for other in linked if isinstance(other, BaseException)]
    return found


def host_port(url: str) -> str:
    """``host:port`` of a URL, the scheme's port when none is written (for a line naming where)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
