"""A minimal HTTP/1.1 client for ranged GETs whose body lands straight in the caller's buffers.

Why not aiohttp for the body: its protocol hands every socket read to its parser as a fresh
``bytes`` object (one copy), and the body then has to be copied again into the page-aligned
buffers O_DIRECT needs. On a client that is CPU-bound (a node pulling at line rate, or the
benchmark's one core), those two copies and their allocations were most of the difference
between the tool and a loop that reads and drops the bodies. Here the connection is an
:class:`asyncio.BufferedProtocol`: the kernel (or the TLS layer) writes the body directly
into the buffer the caller passes to :meth:`Connection.read_into`, about a megabyte per read
(the socket's low-water mark, :data:`RECV_LOW_WATER`).

What it does: GET with keep-alive over TCP or TLS, one request at a time per connection, a
``Content-Length`` body. What it refuses (as :class:`ProtocolError`, which the caller retries
on a new connection): a malformed or oversized head, a chunked or unsized success body.
Error responses are not read: the caller takes the status and headers and the connection
is closed. The pure part (the heads' bytes: :func:`~azcp_cluster.download.httpwire.parse_head`,
:func:`~azcp_cluster.download.httpwire.request_bytes`) is httpwire.py, with no I/O.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

from azcp_cluster.azure.netfailure import network_cause
from azcp_cluster.core.crc import crc32
from azcp_cluster.download.httpwire import HEAD_END, HEAD_LIMIT, Head, ProtocolError, connect_bytes, parse_head

if TYPE_CHECKING:
    from azcp_cluster.azure.proxies import Proxy


# While a body is read, the socket is reported readable only once this many of its bytes
# are queued (SO_RCVLOWAT). A server writes some 64 KiB at a time, and each of those woke
# the event loop for one read; a read now moves up to a megabyte: a tenth of the loop's
# turns, about a quarter of the client's CPU (0.64 -> 0.47 CPU-s/GiB in paired runs), and
# a steadier rate next to the disk's writers.
RECV_LOW_WATER = 1 << 20
# Under TLS, body bytes can already sit inside the TLS layer (asyncio reads up to 256 KiB
# from the socket at a time), where they no longer count against the socket: the mark is
# kept this far below what is left, so that it never waits for bytes that will not come.
TLS_SLACK = 512 * 1024


class ConnectFailed(OSError):
    """A connection could not be made; says to what (the endpoint or the proxy) and why, in one line."""

    def __init__(self, cause: BaseException, what: str) -> None:
        detail = network_cause(cause) or getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        if isinstance(cause, TimeoutError) and str(cause):
            detail += f" ({cause})"  # "no connection within 30 s"
        super().__init__(f"cannot reach {what}: {detail}")
        self.cause_name = type(cause).__name__  # the retry counts' key


class TunnelRefused(Exception):
    """The proxy answered the CONNECT with something other than 2xx: not worth retrying."""

    def __init__(self, status: int, reason: str, proxy: str, target: str) -> None:
        super().__init__(f"proxy {proxy} refused the tunnel to {target}: HTTP {status} {reason}".rstrip())
        self.status = status


CRC_STEP = 256 * 1024  # read_into_crc hashes in steps of at least this: in cache, few calls


class Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection; the socket's bytes go into the head scratch or the caller's buffer.

    States: IDLE (no request out: any byte is an error; reading stays on so that a server
    closing the connection is seen), HEAD (bytes go to the head scratch until the blank
    line), BODY (bytes go into the caller's buffer while :meth:`read_into` waits). Reading is
    paused whenever no buffer is waiting; bytes a transport delivers anyway (Python 3.10's
    TLS layer feeds a whole record after a pause), and body bytes that came with the head,
    are kept in order in small staging chunks and handed over first.
    """

    IDLE, HEAD, BODY = range(3)
    STAGE_CHUNK = 64 * 1024

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self.received = 0  # body bytes received over this connection (for a stall watchdog)
        self._state = self.IDLE
        self._used = False  # a request has been sent on it
        self._head = bytearray(HEAD_LIMIT)
        self._head_len = 0
        self._head_end = -1  # index just past the blank line, once the head is complete
        self._staged: deque[memoryview] = deque()  # body bytes received with no caller buffer
        self._staged_bytes = 0
        self._stage: bytearray | None = None  # the chunk get_buffer handed out for staging
        self._sink: memoryview | None = None  # the caller's buffer, while read_into waits
        self._filled = 0
        # read_into_crc: the CRC-32 of the bytes handed over, taken as the socket's reads land in
        # the caller's buffer, every CRC_STEP bytes while they are still in the CPU's cache (at
        # every read, under TLS a 16 KiB record, the calls cost more than the hash): 0.020 s of
        # a core per GiB over HTTPS here, where a read is 256 to 384 KiB. Over plain HTTP one
        # read brings up to the whole 2 MiB buffer, partly out of cache when hashed (0.049);
        # smaller reads cost more in wakeups than they save (512 KiB: 0.82 CPU-s/GiB, not 0.47).
        self._crc: int | None = None
        self._hashed = 0  # the caller's buffer is hashed up to here
        self._remaining = -1  # body bytes still to come from the socket; -1 until the head is parsed
        self._waiter: asyncio.Future[None] | None = None
        self._reusable = False
        self._keep_alive = False
        self._sock: socket.socket | None = None  # for the low-water mark; None where it cannot be set
        self._slack = 0
        self._low_water = 1  # the socket's SO_RCVLOWAT now
        self._trickle = False  # this body comes slowly: read whatever arrives

    # -- the caller's side ----------------------------------------------------------------

    @classmethod
    async def open(cls, url: str, context: ssl.SSLContext | None, proxy: Proxy | None = None) -> Connection:
        """Connect to the host of ``url`` (TLS for https, with ``context``), through ``proxy`` if given.

        Through a proxy, https goes through a CONNECT tunnel (TLS end to end, the proxy sees
        only the host); http connects to the proxy itself, and the requests then name the
        whole URL (:func:`request_bytes` with ``absolute=True``). A failure to connect is a
        :class:`ConnectFailed` naming what could not be reached.
        """
        parts = urlsplit(url)
        https = parts.scheme.lower() == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if https else 80)
        loop = asyncio.get_running_loop()
        tls = (context or ssl.create_default_context()) if https else None
        if proxy is None:
            try:
                if tls is not None:
                    _, conn = await loop.create_connection(cls, host, port, ssl=tls, server_hostname=host)
                else:
                    _, conn = await loop.create_connection(cls, host, port)
            except (OSError, ssl.SSLError) as exc:
                if isinstance(exc, ssl.SSLError):
                    raise
                raise ConnectFailed(exc, f"{host}:{port}") from exc
            return conn
        try:
            sock = await _dial(loop, proxy.host, proxy.port)
        except OSError as exc:
            raise ConnectFailed(exc, f"proxy {proxy.shown}") from exc
        try:
            if tls is not None:
                await _tunnel(loop, sock, host, port, proxy)
                _, conn = await loop.create_connection(cls, sock=sock, ssl=tls, server_hostname=host)
            else:
                _, conn = await loop.create_connection(cls, sock=sock)
        except BaseException:
            sock.close()
            raise
        return conn

    @property
    def reusable(self) -> bool:
        """Whether the last response was read whole and the connection can carry another request."""
        return self._reusable and not self.closed

    @property
    def awaiting_body(self) -> bool:
        """Whether a caller is waiting for body bytes from the socket (what a stall watchdog watches)."""
        return self._sink is not None

    @property
    def closed(self) -> bool:
        """Whether the connection is gone (closed by either side, or broken)."""
        return self.transport is None or self.error is not None

    async def request(self, data: bytes) -> Head:
        """Send one request and wait for its response's head.

        For a 200 or 206 the body is then read with :meth:`read_into`; any other status
        leaves the body unread and the connection not reusable.
        """
        if self.closed:
            raise ConnectionResetError("connection closed")
        if self._used and not self._reusable:
            raise ProtocolError("the previous response on this connection was not read whole")
        assert self.transport is not None
        self._used, self._reusable = True, False
        self._head_len, self._head_end = 0, -1
        self._staged.clear()
        self._staged_bytes, self._remaining = 0, -1
        self._state = self.HEAD
        self._trickle = False
        self._set_low_water()  # the head: every byte as it comes
        try:
            self.transport.write(data)
        except (AttributeError, RuntimeError):  # Python 3.10: a TLS transport being torn down
            self._fail(ConnectionResetError("connection closed"))
        self._resume()
        while self._state == self.HEAD:
            await self._wait()
        head = parse_head(bytes(self._head[: self._head_end - len(HEAD_END)]))
        if head.status in (200, 206):
            if head.headers.get("transfer-encoding", "identity").lower() != "identity":
                raise ProtocolError(f"unexpected Transfer-Encoding {head.headers['transfer-encoding'][:40]!r}")
            length = head.content_length
            if length is None:
                raise ProtocolError("response without Content-Length")
            if self._staged_bytes > length:
                raise ProtocolError("body longer than Content-Length")
            self._remaining = length - self._staged_bytes
            self._keep_alive = head.keep_alive
            self._set_low_water()
            self._finish_if_done()  # an empty body (or one that came whole with the head) is read
        return head

    async def read_into(self, buf: memoryview) -> int:
        """Fill ``buf`` with the next body bytes (all of it, or up to the body's end); return how many."""
        if self._state != self.BODY or self._remaining < 0:
            raise ProtocolError("no response body to read")
        filled = 0
        while self._staged and filled < len(buf):  # bytes that came before this buffer did
            chunk = self._staged[0]
            take = min(len(chunk), len(buf) - filled)
            buf[filled : filled + take] = chunk[:take]
            filled += take
            self._staged_bytes -= take
            if take == len(chunk):
                self._staged.popleft()
            else:
                self._staged[0] = chunk[take:]
        try:
            if filled < len(buf) and self._remaining:
                self._sink, self._filled = buf, filled
                while self._filled < len(buf) and self._remaining:
                    self._resume()
                    await self._wait()
                filled = self._filled
            return filled
        finally:
            self._sink = None
            self._finish_if_done()

    async def read_into_crc(self, buf: memoryview, crc: int) -> tuple[int, int]:
        """:meth:`read_into`, and ``crc`` carried on over the bytes it handed over (CRC-32)."""
        self._crc, self._hashed = crc, 0
        try:
            got = await self.read_into(buf)
            return got, crc32(buf[self._hashed : got], self._crc)  # what the last step left
        finally:
            self._crc = None

    def trickle(self) -> None:
        """Hand over the body's bytes as they come, however few (a slow body; see RECV_LOW_WATER).

        A stall watchdog calls it when a body shows no progress: bytes under the low-water
        mark wait in the kernel, unseen, and a slow but live server must not look stalled.
        """
        if not self._trickle:
            self._trickle = True
            self._set_low_water()

    def abort(self) -> None:
        """Drop the connection now; a pending read fails."""
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Close the connection (nothing pending)."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    # -- the transport's side -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not subclasses of asyncio.Transport: not checked).
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "SO_RCVLOWAT"):
            self._sock = sock
        self._slack = TLS_SLACK if transport.get_extra_info("ssl_object") is not None else 0

    def get_buffer(self, sizehint: int) -> memoryview:
        self._stage = None  # a read that failed leaves no buffer_updated: forget its chunk
        if self._state == self.BODY:
            sink = self._sink
            if sink is not None and self._remaining > 0 and self._filled < len(sink):
                return sink[self._filled : self._filled + min(len(sink) - self._filled, self._remaining)]
            size = self.STAGE_CHUNK if self._remaining < 0 else min(self.STAGE_CHUNK, max(self._remaining, 1))
            self._stage = bytearray(size)
            return memoryview(self._stage)
        if self._state == self.HEAD and self._head_len < HEAD_LIMIT:
            return memoryview(self._head)[self._head_len :]
        return memoryview(bytearray(4096))  # bytes nobody asked for: read, then fail

    def buffer_updated(self, nbytes: int) -> None:
        if self._state == self.BODY:
            stage, self._stage = self._stage, None
            if stage is None:  # into the caller's buffer
                self._filled += nbytes
                if self._crc is not None and self._filled - self._hashed >= CRC_STEP:
                    assert self._sink is not None
                    self._crc = crc32(self._sink[self._hashed : self._filled], self._crc)
                    self._hashed = self._filled
                self._remaining -= nbytes
                self.received += nbytes
                if self._remaining - self._slack < self._low_water:
                    self._set_low_water()  # never more than what is left to come
                assert self._sink is not None
                if self._filled == len(self._sink) or not self._remaining:
                    self._pause()
                return
            if self._remaining == 0:
                self._fail(ProtocolError("bytes after the end of the response"))
                return
            self._keep(memoryview(stage)[:nbytes])
            self._pause()
            return
        if self._state != self.HEAD:
            self._fail(ProtocolError("bytes from the server with no request out"))
            return
        start = max(0, self._head_len - len(HEAD_END) + 1)
        self._head_len += nbytes
        end = self._head.find(HEAD_END, start, self._head_len)
        if end >= 0:
            self._head_end = end + len(HEAD_END)
            if self._head_len > self._head_end:  # body bytes that came with the head
                self._keep(memoryview(bytes(memoryview(self._head)[self._head_end : self._head_len])))
            self._state = self.BODY
            self._pause()
        elif self._head_len >= HEAD_LIMIT:
            self._fail(ProtocolError(f"response head larger than {HEAD_LIMIT} bytes"))

    def eof_received(self) -> bool:
        # Closed now, not one loop step later when connection_lost comes (Python 3.10's TLS
        # layer drops its transport in between): nobody may reuse the connection meanwhile.
        if self.error is None:
            self.error = ConnectionResetError("connection closed by the server")
        self._wake()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        if self.error is None:
            self.error = exc if exc is not None else ConnectionResetError("connection closed by the server")
        self._wake()

    # -- internals ------------------------------------------------------------------------

    def _keep(self, chunk: memoryview) -> None:
        """Stage body bytes that arrived with no caller buffer waiting (counted as received)."""
        if self._remaining > 0:
            if len(chunk) > self._remaining:
                self._fail(ProtocolError("body longer than Content-Length"))
                return
            self._remaining -= len(chunk)
            if self._remaining - self._slack < self._low_water:
                self._set_low_water()
        self._staged.append(chunk)
        self._staged_bytes += len(chunk)
        self.received += len(chunk)

    def _finish_if_done(self) -> None:
        if self._state == self.BODY and self._remaining == 0 and not self._staged:
            self._state = self.IDLE
            self._reusable = self._keep_alive
            if self._reusable:
                # Read while idle: a server that closes the connection is seen now, not by
                # the next request (any byte that arrives is an error and drops it).
                self._resume()

    def _set_low_water(self) -> None:
        """Set SO_RCVLOWAT for what is being read: 1 for a head or a trickle, else up to RECV_LOW_WATER.

        Never above the body bytes still to come on the socket, or the last of them would
        wait in the kernel for bytes that never come (a FIN or an error still wakes the loop).
        """
        if self._state == self.BODY and self._remaining > 0 and not self._trickle:
            mark = max(1, min(RECV_LOW_WATER, self._remaining - self._slack))
        else:
            mark = 1
        if mark == self._low_water or self._sock is None:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
        except OSError:  # not a TCP socket, or a kernel that refuses: every byte as it comes
            self._sock = None
            return
        self._low_water = mark

    def _resume(self) -> None:
        """Let the transport read; a transport already torn down fails the connection (the next wait raises)."""
        if self.transport is None or self.error is not None:
            return
        try:
            self.transport.resume_reading()
        except (AttributeError, RuntimeError):  # Python 3.10: a TLS transport being torn down
            self._fail(ConnectionResetError("connection closed"))

    def _pause(self) -> None:
        if self.transport is not None:
            try:
                self.transport.pause_reading()
            except (AttributeError, RuntimeError):  # a TLS transport being closed
                self._fail(ConnectionResetError("connection closed"))
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.abort()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        if self.transport is None:
            raise ConnectionResetError("connection closed")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error


async def _dial(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to ``host:port`` (each address in turn)."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        return sock
    raise last or OSError(f"no address for {host}")


async def _tunnel(loop: asyncio.AbstractEventLoop, sock: socket.socket, host: str, port: int, proxy: Proxy) -> None:
    """Ask the proxy on ``sock`` for a tunnel to ``host:port``; return once it is open."""
    await loop.sock_sendall(sock, connect_bytes(host, port, proxy.authorization))
    head = bytearray()
    while HEAD_END not in head:
        if len(head) > HEAD_LIMIT:
            raise ProtocolError(f"proxy {proxy.shown}: CONNECT response head too large")
        # Byte by byte would be slow; a server speaks only after our TLS hello, so nothing
        # but the proxy's head can arrive now, and reading past it cannot take TLS bytes.
        chunk = await loop.sock_recv(sock, 4096)
        if not chunk:
            raise ConnectionResetError(f"proxy {proxy.shown} closed the connection during CONNECT")
        head += chunk
    end = head.index(HEAD_END)
    try:
        reply = parse_head(bytes(head[:end]))
    except ProtocolError as exc:
        raise ProtocolError(f"proxy {proxy.shown}: {exc}") from None
    if not 200 <= reply.status < 300:  # a refusal often carries a page of HTML: not read
        raise TunnelRefused(reply.status, reply.reason, proxy.shown, f"{host}:{port}")
    if end + len(HEAD_END) != len(head):
        raise ProtocolError(f"proxy {proxy.shown}: bytes after the CONNECT response")


class Link:
    """A download worker's connection, kept open between its requests while the server allows."""

    __slots__ = ("conn",)

    def __init__(self) -> None:
        self.conn: Connection | None = None

    def drop(self) -> None:
        """Close the connection, if any; the next request opens a new one."""
        if self.conn is not None:
            self.conn.abort()
            self.conn = None
