"""The ranged-GET HTTP/1.1 client: head parsing (pure) and the connection against scripted servers.

Azurite serves the ordinary responses (every integration test goes through this client);
the scripted loopback servers here produce what a well-behaved server never sends: heads
split byte by byte, chunked or unsized bodies, oversized heads, early closes.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from azcp_cluster.download.http1 import RECV_LOW_WATER, TLS_SLACK, Connection
from azcp_cluster.download.httpwire import HEAD_LIMIT, Head, ProtocolError, parse_head, request_bytes

# -- pure ---------------------------------------------------------------------------------


def test_parse_head_reads_status_and_lower_cases_names() -> None:
    head = parse_head(b'HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\nETag: "0x1"\r\nX-Ms-Error-Code:  Busy ')
    assert (head.version, head.status, head.reason) == ("HTTP/1.1", 206, "Partial Content")
    assert head.headers == {"content-length": "10", "etag": '"0x1"', "x-ms-error-code": "Busy"}
    assert head.content_length == 10
    assert head.keep_alive


def test_parse_head_without_reason_and_repeated_headers() -> None:
    head = parse_head(b"HTTP/1.1 503\r\nVia: a\r\nvia: b\r\nContent-Length: 0\r\ncontent-length: 0")
    assert head.status == 503 and head.reason == ""
    assert head.headers["via"] == "a, b"
    assert head.content_length == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/2 200 OK",
        b"HTTP/1.1 20 OK",
        b"HTTP/1.1 abc OK",
        b"ICY 200 OK",
        b"",
        b"HTTP/1.1 200 OK\r\nno colon here",
        b"HTTP/1.1 200 OK\r\n: empty name",
        b"HTTP/1.1 200 OK\r\nName : space before colon",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
    ],
)
def test_parse_head_refuses_malformed_heads(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_head(raw)


@pytest.mark.parametrize("value", ["-1", "1e3", "12 34", "0x10", "", "\u00b2", "1\u00b3"])
def test_a_bad_content_length_is_a_protocol_error(value: str) -> None:
    head = parse_head(f"HTTP/1.1 200 OK\r\nContent-Length: {value}".encode())
    with pytest.raises(ProtocolError):
        _ = head.content_length


@pytest.mark.parametrize(
    ("raw", "keep"),
    [
        (b"HTTP/1.1 200 OK", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close", False),
        (b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, Close", False),
        (b"HTTP/1.0 200 OK", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive", True),
    ],
)
def test_keep_alive_follows_the_version_and_connection_header(raw: bytes, keep: bool) -> None:
    assert parse_head(raw).keep_alive is keep


def test_request_bytes_has_the_target_host_and_headers() -> None:
    data = request_bytes("http://127.0.0.1:10000/acct/c/a%20b.bin?sv=1&sig=x", {"Range": "bytes=0-9"})
    assert data == (b"GET /acct/c/a%20b.bin?sv=1&sig=x HTTP/1.1\r\nHost: 127.0.0.1:10000\r\nRange: bytes=0-9\r\n\r\n")


def test_request_bytes_makes_a_head_request() -> None:
    data = request_bytes("http://h:1/acct/c/x?sig=s", {"x-ms-version": "v"}, method="HEAD")
    assert data == b"HEAD /acct/c/x?sig=s HTTP/1.1\r\nHost: h:1\r\nx-ms-version: v\r\n\r\n"
    with pytest.raises(ValueError, match="unsupported method"):
        request_bytes("http://h/c/x", {}, method="DELETE")


@pytest.mark.parametrize("value", ["a\r\nInjected: 1", "a\nb", "a\rb"])
def test_request_bytes_refuses_line_breaks_in_headers(value: str) -> None:
    with pytest.raises(ValueError, match="CR or LF"):
        request_bytes("http://h/c/x", {"Authorization": value})


# -- the connection, against scripted servers ---------------------------------------------------

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def _replying(*replies: bytes, close: bool = False) -> Script:
    """A server that answers each request with the next reply, then closes or waits for the client to."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for reply in replies:
            await _read_request(reader)
            writer.write(reply)
            await writer.drain()
        if close:
            writer.close()
        else:
            await reader.read()

    return script


def _run(script: Script, client: Callable[[str], Awaitable[None]], tls: ssl.SSLContext | None = None) -> None:
    async def main() -> None:
        server = await asyncio.start_server(script, "127.0.0.1", 0, ssl=tls)
        port = server.sockets[0].getsockname()[1]
        try:
            scheme = "https" if tls is not None else "http"
            await asyncio.wait_for(client(f"{scheme}://127.0.0.1:{port}/acct/c/blob"), 10)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def _tls_pair(directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server's TLS context with a self-signed certificate, and a client's that trusts it."""
    from azcp_cluster.devtools.certs import make_certificate

    cert, key = make_certificate(directory)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


async def _read_body(conn: Connection, size: int, piece: int) -> bytes:
    out = bytearray(size)
    view = memoryview(out)
    got = 0
    while got < size:
        got += await conn.read_into(view[got : min(size, got + piece)])
    return bytes(out)


def test_a_head_split_byte_by_byte_then_body_in_the_same_packets_then_keep_alive() -> None:
    body = bytes(range(256)) * 40  # 10240 bytes

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        head = f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        for i in range(len(head)):
            writer.write(head[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(body)
        await writer.drain()
        second = await _read_request(reader)
        assert second.startswith(b"GET /acct/c/blob HTTP/1.1\r\n")
        writer.write(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 3\r\n\r\nxyz")
        await writer.drain()
        await reader.read()  # until the client closes

    async def client(url: str) -> None:
        conn = await Connection.open(url, None)
        head = await conn.request(request_bytes(url, {}))
        assert head.status == 206
        assert not conn.reusable  # the body is not read yet
        assert await _read_body(conn, len(body), 1000) == body
        assert conn.reusable and conn.received == len(body)
        head = await conn.request(request_bytes(url, {}))
        assert await _read_body(conn, 3, 3) == b"xyz"
        conn.close()

    _run(script, client)


def test_an_empty_body_leaves_the_connection_reusable_at_once() -> None:
    async def client(url: str) -> None:
        conn = await Connection.open(url, None)
        head = await conn.request(request_bytes(url, {}))
        assert head.content_length == 0 and conn.reusable
        await conn.request(request_bytes(url, {}))
        assert await _read_body(conn, 2, 2) == b"ok"
        conn.close()

    empty = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    _run(_replying(empty, b"HTTP/1.1 206 Partial Content\r\nContent-Length: 2\r\n\r\nok"), client)


def test_body_bytes_that_came_with_the_head_fill_several_small_reads() -> None:
    async def client(url: str) -> None:
        conn = await Connection.open(url, None)
        await conn.request(request_bytes(url, {}))
        assert await _read_body(conn, 10, 3) == b"0123456789"
        assert not conn.reusable  # Connection: close

    _run(_replying(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\n0123456789", close=True), client)


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "Transfer"),
        (b"HTTP/1.1 206 Partial Content\r\n\r\nhello", "Content-Length"),
        (b"HTTP/1.1 206 Partial Content\r\nContent-Length: 2\r\n\r\nhello", "longer"),
        (b"garbage\r\n\r\n", "status line"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * HEAD_LIMIT, "larger than"),
    ],
)
def test_unusable_responses_are_protocol_errors(reply: bytes, message: str) -> None:
    async def client(url: str) -> None:
        conn = await Connection.open(url, None)
        with pytest.raises(ProtocolError, match=message):
            await conn.request(request_bytes(url, {}))
        assert not conn.reusable
        conn.abort()

    _run(_replying(reply), client)


def test_a_body_cut_short_fails_the_read_and_the_connection_is_not_reused() -> None:
    async def client(url: str) -> None:
        conn = await Connection.open(url, None)
        await conn.request(request_bytes(url, {}))
        with pytest.raises(ConnectionResetError):
            await _read_body(conn, 100000, 65536)
        assert conn.received == 5000
        assert conn.closed and not conn.reusable

    _run(_replying(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100000\r\n\r\n" + b"x" * 5000, close=True), client)


def test_an_error_response_is_returned_without_its_body_and_not_reused() -> None:
    async def client(url: str) -> None:
        conn = await Connection.open(url, None)
        head = await conn.request(request_bytes(url, {}))
        assert (head.status, head.headers["retry-after"]) == (503, "1")
        assert not conn.reusable
        conn.abort()

    _run(_replying(b"HTTP/1.1 503 Server Busy\r\nRetry-After: 1\r\nContent-Length: 5\r\n\r\nbusy!"), client)


def test_a_server_closing_an_idle_connection_makes_it_not_reusable() -> None:
    async def client(url: str) -> None:
        conn = await Connection.open(url, None)
        await conn.request(request_bytes(url, {}))
        assert await _read_body(conn, 1, 1) == b"z"
        for _ in range(100):
            if conn.closed:
                break
            await asyncio.sleep(0.01)
        assert conn.closed and not conn.reusable  # the next request opens a new connection

    _run(_replying(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1\r\n\r\nz", close=True), client)


# -- a transport that keeps delivering after a pause ----------------------------------------


class _EagerTransport(asyncio.Transport):
    """Delivers whatever it is fed, paused or not: Python 3.10's TLS layer feeds a whole record."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = b""
        self.paused = False
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += bytes(data)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def abort(self) -> None:
        self.aborted = True


def _feed(conn: Connection, data: bytes, piece: int = 1 << 30) -> None:
    while data:
        buf = conn.get_buffer(-1)
        n = min(len(buf), len(data), piece)
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


async def _eager_request(reply: bytes, piece: int = 1 << 30) -> tuple[Connection, _EagerTransport, Head]:
    """A connection on an eager transport, one request sent, ``reply`` delivered in ``piece``-byte reads."""
    conn = Connection()
    transport = _EagerTransport()
    conn.connection_made(transport)
    pending = asyncio.ensure_future(conn.request(b"GET / HTTP/1.1\r\n\r\n"))
    await asyncio.sleep(0)
    _feed(conn, reply, piece)
    return conn, transport, await pending


def test_bytes_delivered_while_paused_are_staged_and_handed_over_in_order() -> None:
    body = bytes(range(256)) * 1000

    async def main() -> None:
        head = f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        # On past the head, paused or not.
        conn, transport, reply = await _eager_request(head + body[:150_000], piece=50_000)
        assert transport.paused and reply.status == 206
        out = bytearray(len(body))
        view = memoryview(out)
        got = await conn.read_into(view[:10_000])  # served from the staged bytes alone
        assert got == 10_000 and transport.paused
        reading = asyncio.ensure_future(conn.read_into(view[got:]))
        await asyncio.sleep(0)
        assert not transport.paused
        _feed(conn, body[150_000:], piece=30_000)
        got += await reading
        assert got == len(body) and bytes(out) == body
        assert conn.received == len(body)
        assert conn.reusable and not transport.aborted

    asyncio.run(main())


def test_bytes_past_the_end_delivered_while_paused_fail_the_connection() -> None:
    async def main() -> None:
        conn, transport, _ = await _eager_request(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\n\r\n")
        reading = asyncio.ensure_future(conn.read_into(memoryview(bytearray(4))))
        await asyncio.sleep(0)
        _feed(conn, b"abcdEXTRA")
        with pytest.raises(ProtocolError, match="after the end"):
            await reading
        assert transport.aborted and not conn.reusable

    asyncio.run(main())


def test_a_request_on_a_connection_with_an_unread_body_is_refused() -> None:
    async def main() -> None:
        conn, _, _ = await _eager_request(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\n\r\nab")
        with pytest.raises(ProtocolError, match="not read whole"):
            await conn.request(b"GET / HTTP/1.1\r\n\r\n")

    asyncio.run(main())


# -- the socket's low-water mark (SO_RCVLOWAT) ----------------------------------------------


def _low_water(conn: Connection) -> int:
    assert conn.transport is not None
    sock = conn.transport.get_extra_info("socket")
    return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))


def _body_in_pieces_then_silence(body: bytes, pieces: list[int]) -> Script:
    """One 206 whose body comes in ``pieces`` (sizes, with pauses), then neither more bytes nor a close."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        sent = 0
        for size in pieces:
            writer.write(body[sent : sent + size])
            sent += size
            await writer.drain()
            await asyncio.sleep(0.02)
        assert sent == len(body)
        await reader.read()  # no FIN: the client must not wait for bytes that never come

    return script


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_the_low_water_mark_never_waits_for_bytes_that_will_not_come(tls: bool, tmp_path: Path) -> None:
    body = os.urandom(3 * RECV_LOW_WATER + 12345)
    # Pieces that leave an odd tail under the mark at the end, and a buffer size that does
    # not divide the body: every read ends somewhere else.
    pieces = [700_000, RECV_LOW_WATER, 1, RECV_LOW_WATER + 5000, len(body) - 700_001 - 2 * RECV_LOW_WATER - 5000]
    server_tls, client_tls = _tls_pair(tmp_path) if tls else (None, None)
    slack = TLS_SLACK if tls else 0

    async def client(url: str) -> None:
        conn = await Connection.open(url, client_tls)
        assert _low_water(conn) == 1  # nothing set before a body
        await conn.request(request_bytes(url, {}))
        assert _low_water(conn) == min(RECV_LOW_WATER, len(body) - slack)  # set for the body
        out = bytearray(len(body))
        view, got = memoryview(out), 0
        while got < len(body):
            got += await conn.read_into(view[got : min(len(body), got + 1_500_000)])
            left = len(body) - got
            assert _low_water(conn) <= max(1, left - slack)  # never above what is still to come
        assert bytes(out) == body
        assert conn.reusable and _low_water(conn) == 1  # ready for the next head
        conn.close()

    _run(_body_in_pieces_then_silence(body, pieces), client, server_tls)


def test_trickle_takes_the_bytes_as_they_come() -> None:
    body = os.urandom(2 * RECV_LOW_WATER)

    async def client(url: str) -> None:
        conn = await Connection.open(url, None)
        await conn.request(request_bytes(url, {}))
        assert _low_water(conn) == RECV_LOW_WATER
        conn.trickle()
        assert _low_water(conn) == 1
        out = bytearray(len(body))
        view, got = memoryview(out), 0
        while got < len(body):
            got += await conn.read_into(view[got:])
        assert bytes(out) == body
        await conn.request(request_bytes(url, {}))  # the next body: the mark again
        assert _low_water(conn) == RECV_LOW_WATER
        assert await _read_body(conn, len(body), len(body)) == body
        conn.close()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for start in range(0, len(body), 64 * 1024):
            writer.write(body[start : start + 64 * 1024])
            await writer.drain()
        await _read_request(reader)
        writer.write(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        await writer.drain()
        await asyncio.sleep(0.05)  # the head alone first: the whole body is still to come
        writer.write(body)
        await writer.drain()
        await reader.read()

    _run(script, client)


def test_network_failures_are_named_in_plain_words() -> None:
    """What a listing or a GET says when it cannot connect, from real sockets (issue 25)."""
    import socket as socket_module
    import ssl as ssl_module

    from azcp_cluster.azure.netfailure import host_port, network_cause
    from azcp_cluster.devtools import azurite

    def failure(connect: Callable[[], object]) -> BaseException:
        try:
            connect()
        except OSError as exc:  # the failure is what is looked at
            return exc
        raise AssertionError("connected")

    refused = failure(lambda: socket_module.create_connection(("127.0.0.1", azurite.free_port()), timeout=5))
    assert network_cause(refused) == "connection refused"
    unresolved = failure(lambda: socket_module.getaddrinfo("nonexistent.invalid", 443))
    assert network_cause(unresolved) == "name not resolved"
    wrapped = RuntimeError("a library's own error")
    wrapped.__cause__ = unresolved
    assert network_cause(wrapped) == "name not resolved"  # through the chain of causes
    with socket_module.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def handshake() -> object:
            with socket_module.create_connection(("127.0.0.1", port), timeout=0.3) as sock:
                return ssl_module.create_default_context().wrap_socket(sock, server_hostname="localhost")

        assert network_cause(failure(handshake)) == "timed out"  # nobody answers the TLS hello
    assert network_cause(ssl_module.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")) is not None
    assert network_cause(ValueError("not a network failure")) is None
    assert (host_port("https://acct.blob.core.windows.net"), host_port("http://127.0.0.1:10000/acct")) == (
        "acct.blob.core.windows.net:443",
        "127.0.0.1:10000",
    )


@pytest.mark.parametrize("tls", [False, True])
def test_the_crc_of_a_body_taken_as_it_lands_is_the_crc_of_its_bytes(tls: bool, tmp_path: Path) -> None:
    """read_into_crc: some of the body with the head (staged), the rest in pieces of every size
    around the CRC's step, read into buffers of several sizes: the CRC carried over all of them
    is the body's, whatever the cuts (the journal and --verify trust it)."""
    import os
    from zlib import crc32

    from azcp_cluster.download.http1 import CRC_STEP

    body = os.urandom(3 * CRC_STEP + 12345)
    cuts = [1000, CRC_STEP - 1, 1, CRC_STEP + 7, 65536]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:500])
        at = 500
        for cut in [*cuts, len(body)]:
            writer.write(body[at : at + cut])
            await writer.drain()
            await asyncio.sleep(0.01)
            at += cut
            if at >= len(body):
                break
        await reader.read()

    server_tls, client_tls = _tls_pair(tmp_path) if tls else (None, None)

    async def client(url: str) -> None:
        conn = await Connection.open(url, client_tls)
        await conn.request(request_bytes(url, {}))
        out = bytearray(len(body))
        view, got, crc = memoryview(out), 0, 0
        for size in (300, CRC_STEP + 1, 2 * CRC_STEP, len(body)):
            n, crc = await conn.read_into_crc(view[got : min(len(body), got + size)], crc)
            got += n
            if got == len(body):
                break
        assert bytes(out) == body and crc == crc32(body)
        conn.close()

    _run(script, client, server_tls)
