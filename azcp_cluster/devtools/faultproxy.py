"""A fault-injecting HTTP/1.1 reverse proxy that the tests put in front of Azurite.

Every request is forwarded to the emulator and every response streamed back, keep-alive
included (one emulator connection per client connection). Only the ranged GETs that a
:class:`Rule` picks are treated otherwise: they get a 503 ServerBusy with Retry-After, a
500, or their body is reset, stalled or truncated part-way; or a hook runs (e.g. one that
replaces or deletes the blob) before they are forwarded. Listings, HEADs and everything else pass
through untouched.

    rules = [Rule("reset", blob="data/b.bin", nth=2)]
    with FaultProxy(emulator, rules) as proxy:
        run_the_tool(proxy.url("container", "data"))
    assert proxy.injected == 1

With ``start_from=True`` it also serves List Blobs' ``startFrom`` (service version
2026-02-06), which the emulator lacks, by asking the emulator for the names after it (its
marker): the key-range listing is then tested against the real server's pages.

The proxy runs its own event loop on a thread and listens on a free port of 127.0.0.1.
Request bodies are read whole (Content-Length only: no chunked uploads through it).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from types import TracebackType
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

from azcp_cluster.devtools.azurite import ACCOUNT, Emulator

FAULTS = ("503", "500", "reset", "stall", "truncate", "slow", "flip", "shift", "drop-if-match", "no-range", "pass")
BODY_FAULTS = ("reset", "stall", "truncate", "slow", "flip")
# Faults made by changing the request on its way to the emulator, which then answers it honestly.
REQUEST_FAULTS = ("shift", "drop-if-match", "no-range")
COPY_PIECE = 64 * 1024

_ERROR_BODY = '<?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'
_ERRORS = {
    "503": ("503 Service Unavailable", "ServerBusy", "The server is busy."),
    "500": ("500 Internal Server Error", "InternalError", "The server encountered an internal error."),
}


@dataclass
class Rule:
    """Which ranged GETs get which fault.

    The ranged GETs (method GET with a Range header) of blobs whose name matches the glob
    ``blob`` are counted from 1; numbers ``nth`` to ``nth + times - 1`` get ``fault``:

    - ``503``: not forwarded; a 503 with ``Retry-After: retry_after`` and the Azure error
      ``ServerBusy`` (header ``x-ms-error-code`` and XML body);
    - ``500``: not forwarded; a 500 with the Azure error ``InternalError``;
    - ``reset``: the headers and ``partial`` bytes of the body, then a TCP reset (SO_LINGER 0);
    - ``stall``: the headers and ``partial`` bytes, then nothing for ``stall`` seconds, then close;
    - ``truncate``: the headers (with the full Content-Length) and ``partial`` bytes, then a clean close;
    - ``slow``: the whole response, its body ``partial`` bytes at a time with ``stall``
      seconds between pieces (a slow but live server), then a clean close;
    - ``flip``: the whole response with the body's byte at offset ``partial`` (or its last)
      inverted, then a clean close (a bit flipped on the way, past TCP's checksum);
    - ``shift``: the Range asked of the emulator moved ``shift`` bytes on: the answer is another
      range, of the same length, with an honest ``Content-Range`` of it;
    - ``drop-if-match``: the If-Match header left out (a hop that drops it): a blob replaced
      since the listing is served in its new version;
    - ``no-range``: the Range header left out: a 200 with the whole blob;
    - ``pass``: forwarded untouched (with ``before``, a hook that changes the world first).

    ``before``, if set, runs on a worker thread before the picked request is handled.
    ``listing``: the rule counts and picks List Blobs requests (``comp=list``) instead of
    ranged GETs (``503`` and ``500`` only: a listing's answer is no body to cut).
    """

    fault: str
    blob: str = "*"
    nth: int = 1
    times: int = 1
    partial: int = 64 * 1024
    stall: float = 5.0
    retry_after: int = 1
    shift: int = 4096
    before: Callable[[], None] | None = None
    listing: bool = False
    seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r} (one of {', '.join(FAULTS)})")
        if self.nth < 1 or self.times < 1 or self.partial < 0:
            raise ValueError("nth and times must be at least 1, partial zero or more")
        if self.listing and self.fault not in _ERRORS:
            raise ValueError(f"a listing gets a 503 or a 500, not {self.fault!r}")

    def picks(self, blob: str) -> bool:
        """Count a ranged GET of ``blob``; True if this one gets the fault."""
        if not fnmatchcase(blob, self.blob):
            return False
        self.seen += 1
        return self.nth <= self.seen < self.nth + self.times


@dataclass(frozen=True)
class Seen:
    """One request the proxy handled (``fault`` is empty when it went through untouched)."""

    at: float  # time.monotonic() when its head had arrived
    method: str
    blob: str  # the decoded blob name; empty for account and container requests
    range: str  # the Range header, if any
    fault: str


@dataclass
class _Request:
    method: str
    blob: str
    range: str  # the Range (or x-ms-range) header, if any
    ranged: bool
    listing: bool  # a List Blobs request (comp=list)
    raw: bytes  # head and body, as received
    close: bool  # the client asked to close after this one


class FaultProxy:
    """The proxy: a context manager that starts it on entry and stops it on exit."""

    def __init__(
        self,
        emulator: Emulator,
        rules: list[Rule],
        account: str = ACCOUNT,
        start_from: bool = False,
        start_from_served: int | None = None,
    ) -> None:
        self.upstream = (emulator.host, emulator.port)
        self.rules = rules
        self.account = account
        # List Blobs' startFrom (service version 2026-02-06), which the emulator ignores: with
        # ``start_from``, served as the emulator's marker (the name to list after: the same
        # pieces for a client that, as ours, counts a name equal to a cut in the piece before).
        self.start_from = start_from
        # A fault: only the first ``start_from_served`` startFroms served, the later ones
        # passed on to the emulator, which ignores them (a service that takes it, then not).
        self.start_from_served = start_from_served
        self.started_from: list[str] = []  # the startFrom of every listing that had one, served or not
        self.port = 0
        self.log: list[Seen] = []  # every request, in the order they were answered
        self.errors: list[str] = []  # unexpected failures inside the proxy (tests assert none)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def injected(self) -> int:
        """How many requests got a fault (a ``pass`` rule's count too)."""
        return sum(1 for seen in self.log if seen.fault)

    @property
    def endpoint(self) -> str:
        """Path-style service URL of the account, through the proxy."""
        return f"http://127.0.0.1:{self.port}/{self.account}"

    def url(self, container: str, prefix: str = "") -> str:
        """Path-style SOURCE URL for a container and prefix, through the proxy."""
        return f"{self.endpoint}/{container}" + (f"/{prefix}" if prefix else "")

    def __enter__(self) -> FaultProxy:
        ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(ready),), name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10) or not self.port:
            self.__exit__(None, None, None)
            raise RuntimeError("the fault proxy did not start")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
            self.port = int(server.sockets[0].getsockname()[1])
        finally:
            ready.set()
        await self._stop.wait()
        server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client connection: its requests, one after the other."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                request = self._rewrite_start_from(request)
                rule, seen = self._pick(request)
                if rule is not None and rule.fault in _ERRORS:
                    self.log.append(seen)
                    writer.write(_error_response(rule))
                    await writer.drain()
                    if request.close:
                        return
                    continue
                if upstream is None or upstream[0].at_eof():  # none yet, or the emulator closed it
                    if upstream is not None:
                        upstream[1].close()
                    upstream = await asyncio.open_connection(*self.upstream)
                if not await self._forward(request, rule, seen, upstream, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a side went away: end this connection
        except asyncio.CancelledError:
            pass  # the proxy is stopping
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self._tasks.discard(task)
            if upstream is not None:
                upstream[1].close()
            writer.close()

    def _rewrite_start_from(self, request: _Request) -> _Request:
        """Note a listing's startFrom; with :attr:`start_from`, serve it as a marker."""
        line_end = request.raw.index(b"\r\n")
        method, target, version = request.raw[:line_end].decode("latin-1").split(" ", 2)
        parts = urlsplit(target)
        query = parse_qsl(parts.query, keep_blank_values=True)
        start = [value for name, value in query if name == "startFrom"]
        if not start:
            return request
        self.started_from.append(start[0])
        served = self.start_from_served
        if not self.start_from or (served is not None and len(self.started_from) > served):
            return request
        has_marker = any(name == "marker" for name, _ in query)
        kept = [(name, value) for name, value in query if name != "startFrom"]
        if not has_marker:
            kept.append(("marker", start[0]))
        line = f"{method} {parts.path}?{urlencode(kept, quote_via=quote)} {version}".encode("latin-1")
        return replace(request, raw=line + request.raw[line_end:])

    def _pick(self, request: _Request) -> tuple[Rule | None, Seen]:
        """The rule whose fault this request gets (None: none), and its log entry."""
        picked = None
        for rule in self.rules:  # every rule of its kind counts the request; the first that picks it wins
            if (request.listing if rule.listing else request.ranged) and rule.picks(request.blob) and picked is None:
                picked = rule
        fault = picked.fault if picked is not None else ""
        return picked, Seen(time.monotonic(), request.method, request.blob, request.range, fault)

    async def _forward(
        self,
        request: _Request,
        rule: Rule | None,
        seen: Seen,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        client: asyncio.StreamWriter,
    ) -> bool:
        """Send the request on and the response back (cut as ``rule`` says); False to close."""
        if rule is not None and rule.before is not None:
            await asyncio.to_thread(rule.before)
        up_reader, up_writer = upstream
        rewrite = rule is not None and rule.fault in REQUEST_FAULTS
        up_writer.write(_rewritten(request.raw, rule) if rule is not None and rewrite else request.raw)
        await up_writer.drain()
        head = await up_reader.readuntil(b"\r\n\r\n")
        status, headers = _parse_head(head)
        length = int(headers.get("content-length", "-1"))
        if rule is not None and rule.fault in BODY_FAULTS:
            if status in (200, 206) and length > 1:
                self.log.append(seen)
                await _cut(rule, head, length, up_reader, client)
                return False
            seen = replace(seen, fault="")  # no body to cut: forwarded untouched
        self.log.append(seen)
        client.write(head)
        keep = not request.close and headers.get("connection", "").lower() != "close"
        if request.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            pass
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            await _copy_chunked(up_reader, client)
        elif length >= 0:
            await _copy(up_reader, client, length)
        else:  # delimited by the end of the connection
            while piece := await up_reader.read(COPY_PIECE):
                client.write(piece)
                await client.drain()
            keep = False
        await client.drain()
        return keep


def _error_response(rule: Rule) -> bytes:
    """The 503 or 500 response, with Azure's error header and body."""
    status, code, message = _ERRORS[rule.fault]
    body = _ERROR_BODY.format(code=code, message=message).encode()
    lines = [
        f"HTTP/1.1 {status}",
        "Content-Type: application/xml",
        f"Content-Length: {len(body)}",
        f"x-ms-error-code: {code}",
        "x-ms-version: 2023-11-03",
    ]
    if rule.fault == "503":
        lines.append(f"Retry-After: {rule.retry_after}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _cut(
    rule: Rule, head: bytes, length: int, up_reader: asyncio.StreamReader, client: asyncio.StreamWriter
) -> None:
    """Send the head and part of the body, then reset, stall or close as ``rule`` says (or all of it, slowly)."""
    client.transport.set_write_buffer_limits(0)  # drain() then means: handed to the kernel
    client.write(head)
    if rule.fault == "flip":
        at = min(rule.partial, length - 1)
        await _copy(up_reader, client, at)
        byte = await up_reader.readexactly(1)
        client.write(bytes([byte[0] ^ 0xFF]))
        await _copy(up_reader, client, length - at - 1)
        await client.drain()
        return
    if rule.fault == "slow":
        left = length
        while left > 0:
            piece = min(max(rule.partial, 1), left)
            await _copy(up_reader, client, piece)
            left -= piece
            if left:
                await asyncio.sleep(rule.stall)
        return
    await _copy(up_reader, client, min(rule.partial, length // 2))
    await client.drain()
    if rule.fault == "reset":
        sock = client.get_extra_info("socket")
        await _sent_out(sock)  # the client has the part it got (an RST drops what is unsent)
        with contextlib.suppress(OSError):  # (the client has gone meanwhile)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.transport.abort()  # with SO_LINGER 0 the close sends an RST
    elif rule.fault == "stall":
        await asyncio.sleep(rule.stall)
    # truncate (and the end of a stall): the caller closes the connection cleanly


async def _sent_out(sock: socket.socket, within: float = 5.0) -> None:
    """Wait until the kernel has sent every byte written to ``sock`` and the peer has acknowledged
    it (its send queue, ``SIOCOUTQ``, is empty), or ``within`` seconds have passed. A fixed pause
    was too short where a loaded machine's client took its time to read."""
    deadline = time.monotonic() + within
    queued = array.array("i", [0])
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)  # SIOCOUTQ is TIOCOUTQ
        except OSError:
            return
        if queued[0] == 0:
            return
        await asyncio.sleep(0.005)


def _rewritten(raw: bytes, rule: Rule) -> bytes:
    """A request's head changed as a request fault says (its body, if any, untouched)."""
    end = raw.index(b"\r\n\r\n")
    lines = raw[:end].decode("latin-1").split("\r\n")
    out = [lines[0]]
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name in ("range", "x-ms-range"):
            if rule.fault == "no-range":
                continue
            if rule.fault == "shift":
                first, _, last = value.strip().removeprefix("bytes=").partition("-")
                line = f"{name}: bytes={int(first) + rule.shift}-{int(last) + rule.shift}"
        elif name == "if-match" and rule.fault == "drop-if-match":
            continue
        out.append(line)
    return "\r\n".join(out).encode("latin-1") + raw[end:]


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """The next request on a client connection, or None once the client has closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    line, headers = _split_head(head)
    method, target, _version = line.split(" ", 2)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ValueError("chunked request bodies are not supported by the fault proxy")
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    parts = urlsplit(target)
    blob = unquote("/".join(parts.path.split("/")[3:]))  # '', account, container, blob...
    range_ = headers.get("range", headers.get("x-ms-range", ""))
    query = parse_qs(parts.query)
    ranged = method == "GET" and bool(blob) and bool(range_) and "comp" not in query
    listing = method == "GET" and query.get("comp") == ["list"]
    close = headers.get("connection", "").lower() == "close"
    return _Request(method, blob, range_, ranged, listing, head + body, close)


def _split_head(head: bytes) -> tuple[str, dict[str, str]]:
    """The first line and the headers (lower-case names) of a request or response head."""
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    line, headers = _split_head(head)
    return int(line.split(" ", 2)[1]), headers


async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, n: int) -> None:
    """Relay exactly ``n`` bytes."""
    while n > 0:
        piece = await src.read(min(n, COPY_PIECE))
        if not piece:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(piece)
        dst.write(piece)
        await dst.drain()


async def _copy_chunked(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Relay a chunked body as it is, chunk by chunk, through the last chunk's trailers."""
    while True:
        line = await src.readuntil(b"\r\n")
        dst.write(line)
        size = int(line.split(b";", 1)[0], 16)
        if size == 0:
            while (trailer := await src.readuntil(b"\r\n")) != b"\r\n":
                dst.write(trailer)
            dst.write(b"\r\n")
            return
        await _copy(src, dst, size + 2)  # the data and its CRLF


__all__ = ["FAULTS", "FaultProxy", "Rule", "Seen"]
