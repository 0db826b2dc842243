"""The ranged GETs go through HTTPS_PROXY / HTTP_PROXY as the listing does, and NO_PROXY exempts.

Pure: which proxy a URL takes (proxies.py) and the CONNECT request's bytes. For real: a
forward proxy on loopback (devtools/forwardproxy.py) in front of Azurite, over HTTP (the
proxy sees every ranged GET: absolute-form requests) and over HTTPS (a CONNECT tunnel,
TLS end to end), with credentials in the proxy URL; a proxy that refuses, one that is not
there, and NO_PROXY.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from azcp_cluster.azure.proxies import (
    Proxy,
    bypassed,
    from_storage,
    parse_proxy,
    proxy_for,
    proxy_refused,
    refusal_message,
)
from azcp_cluster.core.errors import UsageError
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.certs import make_certificate
from azcp_cluster.devtools.forwardproxy import ForwardProxy, Seen
from azcp_cluster.download.http1 import ConnectFailed, Connection, TunnelRefused
from azcp_cluster.download.httpwire import connect_bytes, request_bytes
from tests.conftest import assert_copies, clean_env, mpiexec_path, run_cli

# -- pure -------------------------------------------------------------------------------------


def test_the_scheme_picks_the_variable_lower_case_first_then_all_proxy() -> None:
    env = {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2", "HTTP_PROXY": "plain:3"}
    assert proxy_for("https://acct.blob.core.windows.net/c", env).host == "lower"  # type: ignore[union-attr]
    got = proxy_for("http://127.0.0.1:10000/devstoreaccount1", env)
    assert got is not None and (got.host, got.port, got.variable) == ("plain", 3, "HTTP_PROXY")
    assert proxy_for("https://a.example/c", {"ALL_PROXY": "http://all:8080"}).port == 8080  # type: ignore[union-attr]
    assert proxy_for("https://a.example/c", {"HTTP_PROXY": "http://p:1"}) is None  # http's proxy is not https's
    assert proxy_for("https://a.example/c", {}) is None
    assert proxy_for("https://a.example/c", {"HTTPS_PROXY": "  "}) is None


def test_credentials_become_basic_auth_and_are_never_shown() -> None:
    proxy = parse_proxy("http://us%40er:p%3Ass@proxy.corp:3128", "HTTPS_PROXY")
    assert proxy.authorization == "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert proxy.shown == "http://proxy.corp:3128 (from HTTPS_PROXY)"
    for secret in ("us@er", "us%40er", "p:ss", "p%3Ass", proxy.authorization):
        assert secret not in proxy.shown and secret not in repr(proxy)
    assert parse_proxy("proxy.corp", "HTTPS_PROXY").port == 80
    assert parse_proxy("http://[::1]:8080", "HTTPS_PROXY").shown.startswith("http://[::1]:8080")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("socks5://p:1080", "only http:// proxies"),
        ("https://p:443", "only http:// proxies"),
        ("http://p:notaport", "port is not a number"),
        ("http://:8080", "no host"),
    ],
)
def test_a_proxy_that_cannot_be_used_is_a_usage_error(value: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        proxy_for("https://acct.blob.core.windows.net/c", {"HTTPS_PROXY": value})
    assert info.value.exit_code == 2 and "HTTPS_PROXY" in str(info.value)


@pytest.mark.parametrize(
    ("host", "port", "no_proxy", "exempt"),
    [
        ("acct.blob.core.windows.net", 443, "*", True),
        ("acct.blob.core.windows.net", 443, "core.windows.net", True),
        ("acct.blob.core.windows.net", 443, ".core.windows.net", True),
        ("acct.blob.core.windows.net", 443, "windows.net.", True),
        ("acct.blob.core.windows.net", 443, "ACCT.blob.core.windows.net", True),
        ("acct.blob.core.windows.net", 443, "s.net", False),  # not on a dot boundary
        ("acct.blob.core.windows.net", 443, "*.core.windows.net", True),
        ("acct.blob.core.windows.net", 443, "other.example, blob.core.windows.net:443", True),
        ("acct.blob.core.windows.net", 443, "blob.core.windows.net:8443", False),
        ("127.0.0.1", 10000, "127.0.0.1", True),
        ("127.0.0.1", 10000, "127.0.0.0/8", True),
        ("127.0.0.1", 10000, "127.0.0.1:10000", True),
        ("127.0.0.1", 10000, "127.0.0.1:10001", False),
        ("127.0.0.1", 10000, "10.0.0.0/8,localhost", False),
        ("::1", 443, "::1", True),
        ("::1", 443, "[::1]:443", True),
        ("::1", 443, "[::1]:80", False),
        ("127.0.0.1", 10000, ":10000", True),  # a port alone: every host on it
        ("127.0.0.1", 10000, " :10001 , *:10000", True),
        ("127.0.0.1", 10000, ":10001", False),
        ("acct.blob.core.windows.net", 443, ":443", True),
        ("acct.blob.core.windows.net", 443, "*:443", True),
        ("acct.blob.core.windows.net", 443, "*:8443", False),
        ("::1", 443, ":443", True),
        ("::1", 443, "[]:443", False),  # an empty bracket names no host
        ("acct.blob.core.windows.net", 443, ":https", False),  # not a port number
        ("localhost", 80, "", False),
        ("localhost", 80, " , ,", False),
    ],
)
def test_no_proxy(host: str, port: int, no_proxy: str, exempt: bool) -> None:
    assert bypassed(host, port, no_proxy) is exempt
    url = f"https://{'[' + host + ']' if ':' in host else host}:{port}/c"
    got = proxy_for(url, {"HTTPS_PROXY": "http://p:1", "no_proxy": no_proxy})
    assert (got is None) is exempt


def test_a_refusal_without_the_services_request_id_is_the_proxys() -> None:
    proxy = parse_proxy("http://proxy.corp:3128", "HTTP_PROXY")
    service = {"x-ms-request-id": "1", "x-ms-error-code": "AuthorizationFailure"}
    assert from_storage(service) and from_storage({"X-Ms-Request-Id": "1"}) and not from_storage({"server": "squid"})
    for status in (401, 403):
        assert proxy_refused(proxy, status, {"content-type": "text/html"})
        assert not proxy_refused(proxy, status, service)  # the service's own: the credentials
        assert not proxy_refused(None, status, {})  # no proxy on the way: nothing to name
    assert proxy_refused(proxy, 407, service)  # the service never sends 407
    assert not proxy_refused(proxy, 404, {}) and not proxy_refused(proxy, 503, {})
    said = refusal_message(proxy, "the listing", 403, "Forbidden")
    assert said.startswith("proxy http://proxy.corp:3128 (from HTTP_PROXY) refused the listing: HTTP 403 Forbidden")
    assert "NO_PROXY" in said and "credentials" not in said
    said = refusal_message(proxy, "the request", 407, "")
    assert said.endswith("refused the request: HTTP 407; check the credentials in the proxy URL")


class _Answer:
    """What the SDK keeps of an HTTP answer (listing._explain reads its headers only)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


def _sdk_error(kind: type[Exception], status: int, code: object, headers: dict[str, str]) -> Exception:
    """An azure-core error as the SDK raises it for an answer: status, reason, error code, response."""
    error = kind("answered")
    error.status_code, error.reason, error.error_code = status, "Reason", code  # type: ignore[attr-defined]
    error.response = _Answer(headers)  # type: ignore[attr-defined]
    return error


def test_the_sdk_listings_failures_name_the_proxy_for_its_own_answers_only() -> None:
    """listing._explain: a refusal the service did not send (no x-ms-request-id) is the proxy's,
    whatever kind the SDK made of it; the service's own answers by their kind and code; a
    request with no answer by the refused tunnel, else the network's cause."""
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ResourceNotFoundError,
        ServiceRequestError,
    )

    from azcp_cluster.azure.credentials import Credential
    from azcp_cluster.azure.listing import _explain
    from azcp_cluster.core.source import parse_blob_url

    source = parse_blob_url("https://acct.blob.core.windows.net/cont/pre?sig=secret")
    SAS = Credential(kind="sas", origin="SAS in the URL", sas="sig=secret")
    refused = "credential used: SAS in the URL; a SAS needs read and list permissions (sp=rl)"
    proxy = parse_proxy("http://proxy.corp:3128", "HTTPS_PROXY")
    service = {"x-ms-request-id": "1"}
    where = "https://acct.blob.core.windows.net/cont/pre?<SAS>"

    def said(error: Exception, through: Proxy | None = proxy) -> str:
        return str(_explain(error, source, SAS, through))

    denied = _sdk_error(ClientAuthenticationError, 403, None, {"server": "squid"})
    assert said(denied).startswith("proxy http://proxy.corp:3128 (from HTTPS_PROXY) refused the listing: HTTP 403")
    assert said(denied, None).startswith(f"{where}: access denied (HTTP 403, AuthenticationFailed); {refused}")
    assert said(denied, None).endswith(" (--auth selects another)") and "secret" not in said(denied, None)
    assert said(_sdk_error(ClientAuthenticationError, 403, None, service)) == said(denied, None)
    assert said(_sdk_error(ResourceNotFoundError, 404, "ContainerNotFound", {})) == (
        "container 'cont' not found at https://acct.blob.core.windows.net"
    )
    assert said(_sdk_error(ResourceNotFoundError, 404, None, {})) == f"{where}: not found (NotFound)"
    assert f"access denied (HTTP 401, InvalidAuthenticationInfo); {refused}" in said(
        _sdk_error(HttpResponseError, 401, "InvalidAuthenticationInfo", service)
    )
    assert said(_sdk_error(HttpResponseError, 503, None, {})) == f"{where}: listing failed (HTTP 503, Reason)"
    unanswered = ServiceRequestError("no answer")
    unanswered.__cause__ = OSError("Tunnel connection failed: 407 Proxy Authentication Required")
    assert said(unanswered) == (
        "proxy http://proxy.corp:3128 (from HTTPS_PROXY) refused the tunnel to "
        "https://acct.blob.core.windows.net: HTTP 407 Proxy Authentication Required"
    )
    assert said(unanswered, None).startswith(
        "cannot reach acct.blob.core.windows.net:443 (https://acct.blob.core.windows.net): "
    )
    assert said(ValueError("?")) == f"{where}: listing failed (ValueError)"
    assert "secret" not in "".join(said(e) for e in (denied, unanswered))


def test_connect_and_absolute_requests() -> None:
    assert connect_bytes("acct.blob.core.windows.net", 443, "Basic eA==") == (
        b"CONNECT acct.blob.core.windows.net:443 HTTP/1.1\r\nHost: acct.blob.core.windows.net:443\r\n"
        b"Proxy-Authorization: Basic eA==\r\n\r\n"
    )
    assert connect_bytes("::1", 443, None).startswith(b"CONNECT [::1]:443 HTTP/1.1\r\n")
    with pytest.raises(ValueError):
        connect_bytes("evil\r\nX: y", 443, None)
    line = request_bytes("http://127.0.0.1:10000/a/b?sv=1", {}, absolute=True).split(b"\r\n")[0]
    assert line == b"GET http://127.0.0.1:10000/a/b?sv=1 HTTP/1.1"


# -- for real ---------------------------------------------------------------------------------

BLOBS = {f"d/part-{i}.bin": os.urandom(1_500_000 + 4099 * i) for i in range(3)}
BLOBS["d/small.txt"] = b"hello"
EXPECTED = {name.removeprefix("d/"): data for name, data in BLOBS.items()}
BLOCK = 512 * 1024
ARGS = ["--block-size", "512KiB", "--no-progress", "--max-retries", "1"]


def _blocks() -> set[tuple[str, str]]:
    """(blob, Range) of every ranged GET a copy of BLOBS makes with BLOCK."""
    want = set()
    for name, data in BLOBS.items():
        for start in range(0, len(data), BLOCK):
            want.add((name, f"bytes={start}-{min(start + BLOCK, len(data)) - 1}"))
    return want


def _ranged(seen: list[Seen]) -> set[tuple[str, str]]:
    return {(s.target.split("?")[0].split("/", 5)[-1], s.range) for s in seen if s.method == "GET" and s.range}


@pytest.fixture(scope="module")
def container(emulator: azurite.Emulator) -> str:
    name = "p" + uuid.uuid4().hex[:20]
    azurite.upload(emulator, name, BLOBS)
    return name


def test_every_ranged_get_goes_through_http_proxy_with_credentials(
    emulator: azurite.Emulator, container: str, tmp_path: Path
) -> None:
    with ForwardProxy(credentials=("stage", "s3cr:t")) as proxy:
        url = proxy.url.replace("s3cr:t", "s3cr%3At")
        env = {**emulator.key_env(), "HTTP_PROXY": url}
        result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), *ARGS], n=2, env=env)
        assert result.returncode == 0, result.output
        assert_copies(tmp_path, EXPECTED, ranks=2)
        # Every block fetched through the proxy, each once (no retries here), and the
        # listing too (the SDK honours the same variable).
        assert _ranged(proxy.seen) == _blocks()
        assert sum(1 for s in proxy.seen if s.range) == len(_blocks())
        assert any("comp=list" in s.target for s in proxy.seen)
        assert "s3cr" not in result.output


@pytest.mark.parametrize("exempt", ["localhost,127.0.0.1", ":{port}"], ids=["hosts", "port-alone"])
def test_no_proxy_matching_the_host_sends_nothing_through_it(
    emulator: azurite.Emulator, container: str, tmp_path: Path, exempt: str
) -> None:
    with ForwardProxy() as proxy:
        env = {**emulator.key_env(), "HTTP_PROXY": proxy.url, "NO_PROXY": exempt.format(port=emulator.port)}
        result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), *ARGS], n=2, env=env)
        assert result.returncode == 0, result.output
        assert_copies(tmp_path, EXPECTED, ranks=2)
        assert proxy.seen == []


@pytest.mark.parametrize("status", [407, 403])
def test_a_proxy_that_refuses_the_blob_gets_ends_the_run_naming_it(
    emulator: azurite.Emulator, container: str, tmp_path: Path, status: int
) -> None:
    def refuse(seen: Seen) -> int | None:
        return status if seen.range else None  # the listing goes through; the ranged GETs do not

    with ForwardProxy(refuse=refuse) as proxy:
        env = {"AZURE_STORAGE_CONNECTION_STRING": emulator.connection_string, "HTTP_PROXY": proxy.url}
        result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), *ARGS], n=2, env=env)
    assert result.returncode == 5, result.output
    assert result.stderr.strip().startswith("azcp-cluster: error"), result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1, result.stderr
    shown = f"proxy http://127.0.0.1:{proxy.port} (from HTTP_PROXY)"
    assert f"{shown} refused the request: HTTP {status} " in errors[0], errors[0]
    assert "CONNECTION_STRING" not in errors[0] and "check the credentials;" not in errors[0]
    assert not any((tmp_path / str(r) / name).exists() for r in range(2) for name in EXPECTED)


@pytest.mark.parametrize("status", [403, 407])
def test_a_proxy_that_refuses_the_listing_is_named_not_the_credentials(
    emulator: azurite.Emulator, container: str, tmp_path: Path, status: int
) -> None:
    """A plain-HTTP SOURCE through a proxy that answers 403 (or 407), with a page of HTML:
    one line naming the proxy (its answer has no x-ms-request-id), not the connection string."""
    with ForwardProxy(refuse=lambda seen: status) as proxy:
        env = {"AZURE_STORAGE_CONNECTION_STRING": emulator.connection_string, "HTTP_PROXY": proxy.url}
        result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), *ARGS], n=2, env=env)
    assert result.returncode == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("azcp-cluster: error [list]"), result.stderr
    reason = {403: "Forbidden", 407: "Proxy Authentication Required"}[status]
    shown = f"proxy http://127.0.0.1:{proxy.port} (from HTTP_PROXY)"
    assert f"{shown} refused the listing: HTTP {status} {reason}" in lines[0], lines[0]
    assert "CONNECTION_STRING" not in lines[0] and "access denied" not in lines[0]


def test_the_services_own_403_through_a_proxy_still_says_credentials(
    emulator: azurite.Emulator, container: str, tmp_path: Path
) -> None:
    """A wrong key through a proxy that passes everything: the 403 is the service's (it has
    x-ms-request-id), so the line names the credentials, not the proxy."""
    wrong = emulator.connection_string.replace(azurite.ACCOUNT_KEY, base64.b64encode(b"not the key").decode())
    with ForwardProxy() as proxy:
        env = {"AZURE_STORAGE_CONNECTION_STRING": wrong, "HTTP_PROXY": proxy.url}
        result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), *ARGS], n=2, env=env)
        assert proxy.seen, "the listing went through the proxy"
    assert result.returncode == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "access denied (HTTP 403" in lines[0] and "credential used: AZURE_STORAGE_CONNECTION_STRING" in lines[0]
    assert "AZURE_STORAGE_CONNECTION_STRING" in lines[0] and "refused" not in lines[0], lines[0]


def test_a_proxy_that_is_not_there_is_named_in_one_line(
    emulator: azurite.Emulator, container: str, tmp_path: Path
) -> None:
    port = azurite.free_port()  # nothing listens there
    env = {**emulator.key_env(), "HTTP_PROXY": f"http://127.0.0.1:{port}"}
    result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), *ARGS], n=2, env=env, timeout=120)
    assert result.returncode == 3, result.output  # the listing goes first, through the same proxy
    errors = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert len(errors) == 1, result.stderr
    assert f"through proxy http://127.0.0.1:{port} (from HTTP_PROXY)" in errors[0], errors[0]


def test_the_ranged_gets_name_what_they_could_not_reach() -> None:
    """The GETs' own connections (what a download's last cause says), on real sockets."""
    absent = azurite.free_port()
    proxy = parse_proxy(f"http://127.0.0.1:{absent}", "HTTPS_PROXY")

    async def attempt(url: str, through: Proxy | None) -> str:
        with pytest.raises((ConnectFailed, TunnelRefused)) as info:
            await Connection.open(url, None, through)
        return str(info.value)

    said = asyncio.run(attempt("https://127.0.0.1:1/c", proxy))
    assert said.startswith("cannot reach proxy http://127.0.0.1:") and str(absent) in said
    assert said.endswith(": connection refused"), said
    said = asyncio.run(attempt(f"http://127.0.0.1:{absent}/c", None))
    assert said == f"cannot reach 127.0.0.1:{absent}: connection refused"
    with ForwardProxy(refuse=lambda seen: 403) as refusing:
        said = asyncio.run(attempt("https://127.0.0.1:1/c", parse_proxy(refusing.url, "HTTPS_PROXY")))
    shown = f"http://127.0.0.1:{refusing.port} (from HTTPS_PROXY)"
    assert said == f"proxy {shown} refused the tunnel to 127.0.0.1:1: HTTP 403 Forbidden"


@pytest.fixture(scope="module")
def https_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[azurite.Emulator]:
    cert, key = make_certificate(tmp_path_factory.mktemp("tls"))
    with azurite.running(cert=str(cert), key=str(key)) as emu:
        azurite.upload(emu, "tunnel", BLOBS)
        yield emu


def test_https_goes_through_a_connect_tunnel(https_emulator: azurite.Emulator, tmp_path: Path) -> None:
    emu = https_emulator
    assert emu.ca_file is not None
    with ForwardProxy(credentials=("stage", "pw")) as proxy:
        env = {
            **emu.key_env(),
            "HTTPS_PROXY": proxy.url,
            "SSL_CERT_FILE": emu.ca_file,
            "REQUESTS_CA_BUNDLE": emu.ca_file,
        }
        result = run_cli([emu.url("tunnel", "d"), str(tmp_path / "{rank}"), *ARGS], n=2, env=env)
        assert result.returncode == 0, result.output
        assert_copies(tmp_path, EXPECTED, ranks=2)
        tunnels = proxy.requests("CONNECT")
        # The listing's and the GETs' (at least one per downloading rank); nothing in clear.
        assert len(tunnels) >= 3 and {s.target for s in tunnels} == {f"127.0.0.1:{emu.port}"}
        assert not proxy.requests("GET")


def test_a_proxy_that_refuses_the_tunnel_ends_the_run_naming_it(
    https_emulator: azurite.Emulator, tmp_path: Path
) -> None:
    """A 407 with a page of HTML (as squid sends it): the listing, first through it, names the
    proxy and its answer at once (not after a minute and a half of the SDK's retries)."""
    emu = https_emulator
    assert emu.ca_file is not None
    with ForwardProxy(refuse=lambda seen: 407) as proxy:
        env = {
            **emu.key_env(),
            "HTTPS_PROXY": proxy.url,
            "SSL_CERT_FILE": emu.ca_file,
            "REQUESTS_CA_BUNDLE": emu.ca_file,
        }
        started = time.monotonic()
        result = run_cli([emu.url("tunnel", "d"), str(tmp_path / "{rank}"), "--no-progress"], n=2, env=env)
        took = time.monotonic() - started
    errors = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert result.returncode == 3, result.output  # the listing goes first, through the same proxy
    assert len(errors) == 1, result.stderr
    assert f"proxy http://127.0.0.1:{proxy.port} (from HTTPS_PROXY) refused the tunnel" in errors[0], errors[0]
    assert "HTTP 407 Proxy Authentication Required" in errors[0], errors[0]
    assert len(proxy.requests("CONNECT")) == 1 and took < 30, (took, proxy.seen)


def test_the_ranged_gets_read_a_refusal_with_a_body() -> None:
    """A refused CONNECT whose answer has a body is a refusal (not a malformed response, retried)."""
    with ForwardProxy(refuse=lambda seen: 407) as refusing:
        proxy = parse_proxy(refusing.url, "HTTPS_PROXY")

        async def attempt() -> None:
            await Connection.open("https://127.0.0.1:1/c", None, proxy)

        with pytest.raises(TunnelRefused) as info:
            asyncio.run(attempt())
    assert info.value.status == 407 and "HTTP 407 Proxy Authentication Required" in str(info.value)


def test_ranks_that_disagree_about_the_proxy_still_list_one_way(
    emulator: azurite.Emulator, container: str, tmp_path: Path
) -> None:
    # Only rank 1 has the proxy in its environment (an `mpirun -x` forgotten on some hosts):
    # the listing must take one path on every rank (the SDK's, on rank 0), never two.
    with ForwardProxy() as proxy:
        program = [sys.executable, "-m", "azcp_cluster", emulator.url(container, "d"), str(tmp_path / "{rank}"), *ARGS]
        cmd = [mpiexec_path(), "-n", "1", *program, ":", "-n", "1", "-env", "HTTP_PROXY", proxy.url, *program]
        done = subprocess.run(cmd, env=clean_env(emulator.key_env()), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert_copies(tmp_path, EXPECTED, ranks=2)
        assert proxy.seen and all(seen.range for seen in proxy.seen), "rank 1's GETs only: rank 0 listed"
