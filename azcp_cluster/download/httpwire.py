"""The bytes of HTTP/1.1 heads: a request's, a proxy CONNECT's, and a response's parsed. Pure code.

Apart from the connection (http1.py, an asyncio protocol that receives bodies into the
caller's buffers) because this part has no I/O at all: strings in, bytes out, and back. It
refuses what the client cannot use as :class:`ProtocolError`, which the downloader retries
on a new connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

HEAD_LIMIT = 64 * 1024  # status line and headers; Azure's are under 2 KiB
HEAD_END = b"\r\n\r\n"  # the blank line that ends a head


class ProtocolError(Exception):
    """The server's response cannot be used (malformed, unsized, too large a head)."""


def connect_bytes(host: str, port: int, authorization: str | None) -> bytes:
    """The bytes of ``CONNECT host:port`` to a forward proxy (``authorization``: Proxy-Authorization)."""
    if any(c in host for c in "\r\n /") or (authorization and ("\r" in authorization or "\n" in authorization)):
        raise ValueError("CR, LF or a space inside a CONNECT target or header")
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
    if authorization:
        lines.append(f"Proxy-Authorization: {authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass(frozen=True)
class Head:
    """Status line and headers of a response (header names lower-cased)."""

    version: str
    status: int
    reason: str
    headers: dict[str, str]

    @property
    def content_length(self) -> int | None:
        """The body's size as announced, or None."""
        value = self.headers.get("content-length")
        if value is None:
            return None
        if not (value.isascii() and value.isdigit()):
            raise ProtocolError(f"bad Content-Length {value[:40]!r}")
        return int(value)

    @property
    def keep_alive(self) -> bool:
        """Whether the connection can carry another request after this body."""
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


def parse_head(data: bytes) -> Head:
    """Parse a status line and headers (without the blank line that ends them)."""
    try:
        text = data.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise ProtocolError("undecodable response head") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ", 2)
    status = parts[1] if len(parts) > 1 else ""
    if not parts[0].startswith("HTTP/1.") or not (len(status) == 3 and status.isascii() and status.isdigit()):
        raise ProtocolError(f"malformed status line {lines[0][:60]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ProtocolError(f"malformed header line {line[:60]!r}")
        key = name.lower()
        value = value.strip()
        if key not in headers:
            headers[key] = value
        elif key == "content-length":  # repeated: allowed only when it says the same
            if headers[key] != value:
                raise ProtocolError("conflicting Content-Length headers")
        else:
            headers[key] = f"{headers[key]}, {value}"
    return Head(parts[0], int(parts[1]), parts[2] if len(parts) > 2 else "", headers)


def request_bytes(url: str, headers: dict[str, str], method: str = "GET", *, absolute: bool = False) -> bytes:
    """The bytes of ``GET url`` (or ``method``, e.g. ``HEAD``) with ``headers`` (the URL already percent-encoded).

    A ``HEAD`` response has no body: read its head with :meth:`Connection.request`, then
    drop the connection. ``absolute``: the request line names the whole URL, as a request
    for an ``http://`` URL sent to a forward proxy does.
    """
    if method not in ("GET", "HEAD"):
        raise ValueError(f"unsupported method {method!r}")
    parts = urlsplit(url)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    if absolute:
        target = f"{parts.scheme}://{parts.netloc}{target}"
    fields = [target, parts.netloc, *headers, *headers.values()]
    if any("\r" in f or "\n" in f for f in fields):
        raise ValueError("CR or LF inside a request line or header")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """A ``Content-Range`` of bytes parsed: (first, last, total; None for ``*``), or None when
    absent or malformed (an answer that does not say which bytes it holds)."""
    if value is None:
        return None
    unit, _, rest = value.strip().partition(" ")
    span, _, total = rest.partition("/")
    first, _, last = span.partition("-")
    numbers = (first, last) + (() if total == "*" else (total,))
    if unit.lower() != "bytes" or not all(n.isascii() and n.isdigit() for n in numbers):
        return None
    return int(first), int(last), None if total == "*" else int(total)


def same_etag(listed: str, answered: str) -> bool:
    """Whether an answer's ``ETag`` header names the listed version (the listing gives it without
    the quotes the header has; a weak tag never equals a strong one)."""

    def bare(tag: str) -> str:
        tag = tag.strip()
        return tag[1:-1] if len(tag) >= 2 and tag[0] == tag[-1] == '"' else tag

    return bare(listed) == bare(answered)


def http_date(value: str | None) -> float | None:
    """An HTTP date (``Last-Modified``) as seconds since the epoch, or None when absent or unreadable."""
    if not value:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    # "-0000" (RFC 5322: no zone information) parses as naive, which .timestamp() would take as
    # local time; an HTTP date is always GMT.
    return (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).timestamp()
