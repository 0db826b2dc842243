"""A forward proxy on loopback for the tests: CONNECT tunnels and absolute-form requests.

What a site's mandatory proxy does, small: ``CONNECT host:port`` opens a tunnel (TLS end
to end, only the target is seen); ``GET http://host:port/path`` (an http URL sent to a
proxy) is rewritten to ``GET /path`` and forwarded, on one upstream connection per client
connection, with every request line and its Range recorded. With ``credentials`` it
answers 407 to a request without the matching ``Proxy-Authorization``; with ``refuse`` it
answers that status to the requests that predicate picks.

    with ForwardProxy() as proxy:
        env["HTTP_PROXY"] = proxy.url
        ...
    assert proxy.seen  # (method, target, range) of every request

It runs its own event loop on a thread and listens on a free port of 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

_END = b"\r\n\r\n"


@dataclass(frozen=True)
class Seen:
    """One request the proxy was asked for."""

    method: str  # GET, HEAD, CONNECT, ...
    target: str  # the absolute URL, or host:port for a CONNECT
    range: str  # its Range header, or ""


class ForwardProxy:
    """A CONNECT and absolute-form HTTP/1.1 proxy on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        credentials: tuple[str, str] | None = None,
        refuse: Callable[[Seen], int | None] | None = None,
    ) -> None:
        self.credentials = credentials
        self.refuse = refuse or (lambda seen: None)
        self.seen: list[Seen] = []
        self.port = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        """The proxy's URL, with the credentials if it wants them."""
        if self.credentials:
            user, password = self.credentials
            return f"http://{user}:{password}@127.0.0.1:{self.port}"
        return f"http://127.0.0.1:{self.port}"

    def requests(self, method: str) -> list[Seen]:
        """The requests seen so far with ``method``."""
        with self._lock:
            return [s for s in self.seen if s.method == method]

    def __enter__(self) -> ForwardProxy:
        ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve(ready)), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the forward proxy did not start")
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await self._stop.wait()

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def _authorized(self, headers: dict[str, str]) -> bool:
        if self.credentials is None:
            return True
        user, password = self.credentials
        want = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        return headers.get("proxy-authorization") == want

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        pump: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    head = await reader.readuntil(_END)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, version = [*lines[0].split(" "), "", ""][:3]
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                seen = Seen(method, target, headers.get("range", ""))
                self._record(seen)
                status = None if self._authorized(headers) else 407
                status = status or self.refuse(seen)
                if status is not None:
                    reason = {407: "Proxy Authentication Required", 403: "Forbidden"}.get(status, "Refused")
                    # With a page of HTML, as squid and most proxies answer.
                    page = f"<html><body><h1>{status} {reason}</h1></body></html>\n".encode()
                    writer.write(
                        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/html\r\nContent-Length: {len(page)}\r\n"
                        'Connection: close\r\nProxy-Authenticate: Basic realm="test"\r\n\r\n'.encode("latin-1")
                        + page
                    )
                    await writer.drain()
                    return
                if method == "CONNECT":
                    host, _, port = target.rpartition(":")
                    up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
                    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    await writer.drain()
                    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
                    return
                parts = urlsplit(target)
                if upstream is None:
                    upstream = await asyncio.open_connection(parts.hostname, parts.port or 80)
                    pump = asyncio.create_task(_pipe(upstream[0], writer))
                origin = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                kept = [ln for ln in lines[1:] if ln and not ln.lower().startswith("proxy-")]
                rewritten = "\r\n".join([f"{method} {origin} {version}", *kept]) + "\r\n\r\n"
                upstream[1].write(rewritten.encode("latin-1"))
                length = int(headers.get("content-length", "0") or 0)
                if length:
                    upstream[1].write(await reader.readexactly(length))
                await upstream[1].drain()
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            return
        finally:
            if pump is not None:
                pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump
            if upstream is not None:
                upstream[1].close()
            writer.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends; then end ``dst``'s writing side."""
    try:
        while True:
            data = await src.read(256 * 1024)
            if not data:
                break
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if dst.can_write_eof():
                dst.write_eof()
