"""Fast and helpful failures (issue 41): a failure that asking again cannot mend ends the run at
once, a transient one is said at its first retry, a refusal says what credential to set.

Against real parts: the CLI under a real ``mpiexec`` and without it, Azurite over HTTP and
over HTTPS, a port nobody listens on, a name under ``.invalid`` (RFC 6761: never resolves),
and the fault proxy in front of Azurite for the transient 503s.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from azcp_cluster.api import make_config
from azcp_cluster.azure import bloblist, blobrest
from azcp_cluster.azure.credentials import Authorizer, resolve_credential
from azcp_cluster.azure.netfailure import hopeless
from azcp_cluster.core.blocks import blocks_for
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import DownloadError, ListError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.plan import Shard
from azcp_cluster.core.retry import RetryNotices
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.certs import make_certificate
from azcp_cluster.devtools.faultproxy import FaultProxy, Rule
from azcp_cluster.download.downloader import Downloader
from azcp_cluster.run.notices import NOTICES
from tests.conftest import assert_copies, run_cli

# The acceptance's bound, on the run's own time (the report's [total]) and on what the user
# waits for beyond a run that only starts and exits (the launcher's and the interpreters'
# start-up, which a loaded machine stretches, timed beside it). Retried (5 times, backoff from
# 0.5 s doubling, equal jitter), the same failures take 7.75 s more at the least.
SLOWEST = 3.0
BLOBS = {"data/a.bin": b"a" * 70_000, "data/b.bin": b"b" * 5_000}
NOTICE = re.compile(
    r"azcp-cluster: notice: rank (\d): retrying \(1/5\) "
    r"(GET of 'data/[ab]\.bin' bytes 0-\d+|listing of '\w+/data/'): HTTP 503 ServerBusy"
)


@pytest.fixture(scope="module")
def tls_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[azurite.Emulator]:
    """Azurite speaking HTTPS only."""
    cert, key = make_certificate(tmp_path_factory.mktemp("tls"))
    with azurite.running(cert=str(cert), key=str(key)) as emu:
        yield emu


@pytest.fixture(scope="module")
def container(emulator: azurite.Emulator) -> str:
    """A private container (no public access) holding :data:`BLOBS`."""
    name = "f" + uuid.uuid4().hex[:20]
    azurite.upload(emulator, name, BLOBS)
    return name


# Each case: SOURCE from the HTTP and the HTTPS emulators, and what its one line says.
UNREACHABLE: dict[str, Callable[[azurite.Emulator, azurite.Emulator], tuple[str, str]]] = {
    "nothing-listening": lambda e, t: (
        f"http://127.0.0.1:{azurite.free_port()}/{azurite.ACCOUNT}/data",
        "): connection refused",
    ),
    "no-such-name": lambda e, t: (f"http://azcp-nowhere.invalid/{azurite.ACCOUNT}/data", "): name not resolved"),
    # OpenSSL's reason for a first answer that is no TLS record varies with its version.
    "tls-to-a-plain-port": lambda e, t: (f"https://127.0.0.1:{e.port}/{azurite.ACCOUNT}/data", "then use http://)"),
    "plain-http-to-a-tls-port": lambda e, t: (
        f"http://127.0.0.1:{t.port}/{azurite.ACCOUNT}/data",
        "): the port speaks TLS; use https://",
    ),
}


@pytest.mark.parametrize("n", [0, 2], ids=["no-mpiexec", "mpiexec-n-2"])
@pytest.mark.parametrize("case", sorted(UNREACHABLE))
def test_a_failure_retrying_cannot_mend_ends_the_run_at_once_with_one_line(
    emulator: azurite.Emulator, tls_emulator: azurite.Emulator, tmp_path: Path, case: str, n: int
) -> None:
    source, words = UNREACHABLE[case](emulator, tls_emulator)
    started = time.monotonic()
    refused = run_cli([source, str(tmp_path / "node{rank}"), "--block-size", "0"], n=n, env=emulator.key_env())
    start_up = time.monotonic() - started
    assert refused.returncode == 2, refused.output  # an option refused: started and exited
    started = time.monotonic()
    result = run_cli(
        [source, str(tmp_path / "node{rank}")], n=n, env=emulator.key_env(), json_path=tmp_path / "report.json"
    )
    took = time.monotonic() - started
    assert result.returncode == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line: no "retrying" notice either
    assert lines[0].startswith("azcp-cluster: error [list]: rank 0: cannot reach 127.0.0.1:") or case == "no-such-name"
    assert words in lines[0], lines[0]
    assert result.json is not None and result.json["exit_code"] == 3
    own = result.json["stages"]["total"]["seconds"]
    assert 0 < own < SLOWEST, f"{own:.1f} s of its own: {lines[0]}"
    assert took < start_up + SLOWEST, f"{took:.1f} s, {start_up:.1f} s to start and exit: {lines[0]}"


@pytest.mark.parametrize("n", [0, 2], ids=["no-mpiexec", "mpiexec-n-2"])
@pytest.mark.parametrize("what", ["get", "get-by-workers", "listing"])
def test_503_twice_then_200_is_said_at_the_first_retry_and_the_copy_completes(
    emulator: azurite.Emulator, container: str, tmp_path: Path, what: str, n: int
) -> None:
    rules = [Rule("503", times=2, listing=what == "listing")]
    # Download workers' retries are said by their rank, in its rhythm.
    workers = ["--download-workers", "2"] if what == "get-by-workers" else []
    with FaultProxy(emulator, rules) as proxy:
        args = [proxy.url(container, "data"), str(tmp_path / "{rank}"), *workers]
        result = run_cli(args, n=n, env=emulator.key_env())
        assert proxy.injected == 2 and not proxy.errors
    assert result.returncode == 0, result.output
    assert_copies(tmp_path, {name.removeprefix("data/"): data for name, data in BLOBS.items()}, ranks=max(n, 1))
    notices = [line for line in result.stderr.splitlines() if "retrying" in line]
    # The first retry said at once; the second, a second later (Retry-After: 1), only counted:
    # one line, or one per rank where each rank met one 503.
    assert 1 <= len(notices) <= 2, result.stderr
    matches = [NOTICE.fullmatch(line) for line in notices]
    assert all(matches), notices
    assert len({m.group(1) for m in matches if m}) == len(notices), notices  # never twice by one rank
    assert ("GET of" in notices[0]) == (what != "listing"), notices
    if what != "listing":
        assert "[cluster] retries: 2 (503=2)" in result.stdout, result.stdout


def test_an_anonymous_403_names_what_to_set(emulator: azurite.Emulator, container: str, tmp_path: Path) -> None:
    result = run_cli([emulator.url(container, "data"), str(tmp_path / "{rank}")], n=2, env={})
    assert result.returncode == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert "access denied (HTTP 403, AuthorizationFailure); no credential was sent (anonymous access)" in line
    for hint in ("a SAS with read and list (sp=rl) in the URL", "AZURE_STORAGE_SAS_TOKEN", "`az login`",
                 "--auth managed-identity"):  # fmt: skip
        assert hint in line, line


def test_a_refused_key_is_named_without_its_secret(emulator: azurite.Emulator, container: str, tmp_path: Path) -> None:
    key = "QmFkS2V5Rm9yVGVzdHNPbmx5QmFkS2V5Rm9yVGVzdHNPbmx5QmFkS2V5Rm9yVGVzdHM="
    env = {"AZURE_STORAGE_ACCOUNT": azurite.ACCOUNT, "AZURE_STORAGE_KEY": key}
    result = run_cli([emulator.url(container, "data"), str(tmp_path / "{rank}")], n=0, env=env)
    assert result.returncode == 3, result.output
    line = result.stderr.strip()
    assert "\n" not in line and key not in result.output and key[:12] not in result.output
    assert "access denied (HTTP 403" in line and "credential used: AZURE_STORAGE_ACCOUNT/AZURE_STORAGE_KEY" in line
    assert f"it must be a key of account '{azurite.ACCOUNT}'" in line and "(--auth selects another)" in line


def _refused_source(tmp_path: Path, **options: object) -> tuple[str, Config]:
    source = f"http://127.0.0.1:{azurite.free_port()}/{azurite.ACCOUNT}/gone"
    return source, make_config(source, str(tmp_path / "dest"), {"max_retries": 2, **options})


@pytest.mark.parametrize("answered", [False, True], ids=["first-contact", "after-an-answer"])
def test_a_refused_listing_request_is_retried_only_after_the_endpoint_has_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answered: bool
) -> None:
    monkeypatch.setattr("azcp_cluster.core.retry.backoff_delay", lambda *args: 0.0)
    source, cfg = _refused_source(tmp_path)
    parsed = parse_blob_url(source)
    told: list[tuple[int, int, str, str]] = []
    lister = blobrest.Lister(parsed, Authorizer(parsed, resolve_credential(parsed, {}), time.time), cfg,
                             notify=lambda *retry: told.append(retry))  # fmt: skip
    lister.answered = answered  # as after a first page: a refusal may be a front-end's blip
    lister.plain(True)

    async def head() -> None:
        try:
            await lister.properties("a.bin")
        finally:
            await lister.close()

    with pytest.raises(blobrest.Unreachable, match="connection refused"):
        asyncio.run(head())
    assert told == ([(1, 2, "HEAD of 'gone/a.bin'", "connection refused"), (2, 2, "HEAD of 'gone/a.bin'",
                     "connection refused")] if answered else [])  # fmt: skip


def test_a_refused_get_is_retried_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The downloads start after the endpoint answered the listing: a refused GET is a
    front-end's blip, retried and said (the listing, the first contact, fails at once)."""
    monkeypatch.setattr("azcp_cluster.core.retry.backoff_delay", lambda *args: 0.0)
    source, cfg = _refused_source(tmp_path)
    parsed = parse_blob_url(source)
    (tmp_path / "dest").mkdir()
    tree = DestTree(str(tmp_path / "dest"), create=True)
    tree.prepare("a.bin", 1000)
    files = [FileEntry(name="a.bin", path="a.bin", size=1000)]
    told: list[tuple[int, int, str, str]] = []
    auth = Authorizer(parsed, resolve_credential(parsed, {}), time.time)
    downloader = Downloader(files, tree, auth, cfg, notify=lambda *retry: told.append(retry))
    try:
        with pytest.raises(DownloadError) as failed:
            downloader.run(blocks_for([Shard(0, 0, 1000, 0)], cfg.block_size))
    finally:
        tree.close()
    assert "connection refused" in str(failed.value)
    assert downloader.stats.retries == 2
    assert [n for n, *_ in told] == [1, 2]


def test_what_retrying_cannot_mend_is_told_from_what_it_can() -> None:
    def raised(make: Callable[[], object]) -> BaseException:
        try:
            make()
        except BaseException as exc:
            return exc
        raise AssertionError("nothing raised")

    refused = raised(lambda: socket.create_connection(("127.0.0.1", azurite.free_port()), timeout=2))
    wrapped = OSError("connect failed")
    wrapped.__cause__ = refused
    assert hopeless(refused) and hopeless(wrapped)
    assert hopeless(raised(lambda: socket.getaddrinfo("azcp-nowhere.invalid", 80)))
    assert hopeless(ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number"))
    assert not hopeless(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
    for transient in (ConnectionResetError(104, "reset"), TimeoutError(), ssl.SSLEOFError(8, "EOF"), OSError()):
        assert not hopeless(transient), transient


def test_retry_notices_say_the_first_then_one_every_few_seconds_with_the_count() -> None:
    said: list[str] = []
    now = [100.0]
    notices = RetryNotices(said.append, lambda: now[0], every=5.0)
    notices.start("rank 3")
    notices.retrying(1, 5, "GET of 'a\nb' bytes 0-9", "HTTP 503 ServerBusy")
    for step in range(10):  # a storm: ten more within 4.5 s
        now[0] += 0.45
        notices.retrying(2, 5, f"GET of 'c{step}'", "HTTP 503 ServerBusy")
    now[0] += 1.0
    notices.retrying(3, 5, "listing of 'c/'", "connection reset")
    assert said == [
        "azcp-cluster: notice: rank 3: retrying (1/5) GET of 'a\\nb' bytes 0-9: HTTP 503 ServerBusy",
        "azcp-cluster: notice: rank 3: retrying (3/5) listing of 'c/': connection reset "
        "(and 10 other retries in the last 6 s)",
    ]
    assert notices.count == 12
    notices.start("rank 0")  # a new run: its first retry said at once
    notices.retrying(1, 5, "x", "y")
    assert said[-1] == "azcp-cluster: notice: rank 0: retrying (1/5) x: y"


def test_the_listing_fails_at_once_at_its_first_step_and_retries_in_the_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The later steps (other ranks' directories, a listing of minutes) come after the endpoint
    # answered the first: a refusal there may be a front-end's blip, said and retried.
    monkeypatch.setattr("azcp_cluster.core.retry.backoff_delay", lambda *args: 0.0)
    source, cfg = _refused_source(tmp_path)
    parsed = parse_blob_url(source)
    auth = Authorizer(parsed, resolve_credential(parsed, {}), time.time)
    NOTICES.start("rank 0")
    with pytest.raises(ListError, match=r"connection refused$"):
        bloblist.list_start(parsed, auth, cfg, 8)
    assert "retrying" not in capsys.readouterr().err
    NOTICES.start("rank 1")
    with pytest.raises(ListError, match=r"connection refused$"):
        bloblist.list_folders(parsed, auth, cfg, ["a/", "b/"])
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("azcp-cluster: notice: rank 1: retrying (1/2) listing of 'gone/"), said


class _Blip:
    """A TCP forwarder to the emulator that, once a listing request has gone through, stops
    listening for ``down`` seconds (a front-end restarting: connections refused), then listens
    again on the same port. The refusal a real server cannot be made to give on cue."""

    def __init__(self, emulator: azurite.Emulator, down: float) -> None:
        self.upstream = (emulator.host, emulator.port)
        self.down = down
        self.port = azurite.free_port()
        self.blipped = threading.Event()
        self.closed = False
        self._listener = self._listen()

    def _listen(self) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        threading.Thread(target=self._serve, args=(listener,), daemon=True).start()
        return listener

    def _serve(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.upstream)
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while data := src.recv(65536):
                if requests and b"comp=list" in data and not self.blipped.is_set():
                    # Stop listening before the listing goes on, so no later connection can be
                    # queued in the backlog (a queued one would be reset, not refused).
                    self.blipped.set()
                    self._stop_listening()
                    threading.Thread(target=self._blip, daemon=True).start()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _stop_listening(self) -> None:
        # close() alone leaves the socket listening while _serve blocks in accept() on it (the
        # call holds the file), and connections queued meanwhile are reset when it returns;
        # shutdown() ends the listening at once and wakes accept().
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _blip(self) -> None:
        # The listing's own connection is open already: its answer comes back.
        time.sleep(self.down)
        if not self.closed:
            self._listener = self._listen()

    def close(self) -> None:
        self.closed = True
        self._stop_listening()


def test_a_refusal_after_the_listing_answered_is_a_blip_retried_not_the_end(
    emulator: azurite.Emulator, container: str, tmp_path: Path
) -> None:
    """The endpoint answered the listing; a front-end then refusing connections for a while is
    retried by the downloads (said once), and the copy completes: not exit 5 at the first GET."""
    # 2.5 s from the listing: the first GET comes 0.1 to 0.3 s after it here, so a loaded machine
    # has room before the refusals end, and the retries' backoff (7.75 s at the least for all
    # five) outlasts the outage.
    blip = _Blip(emulator, down=2.5)
    try:
        source = f"http://127.0.0.1:{blip.port}/{azurite.ACCOUNT}/{container}/data"
        result = run_cli([source, str(tmp_path / "{rank}")], n=2, env=emulator.key_env())
    finally:
        blip.close()
    assert blip.blipped.is_set()
    assert result.returncode == 0, result.output
    assert_copies(tmp_path, {name.removeprefix("data/"): data for name, data in BLOBS.items()}, ranks=2)
    assert "retrying (1/5) GET of" in result.stderr and "connection refused" in result.stderr, result.stderr


def test_verbose_names_the_credential_it_sends_never_its_secret(
    emulator: azurite.Emulator, container: str, tmp_path: Path
) -> None:
    """A new user's find: ``-v`` said nothing of which credential was picked; now one line on
    rank 0, its origin and kind, never the key; not without ``-v``."""
    args = [emulator.url(container, "data"), str(tmp_path / "{rank}")]
    verbose = run_cli([*args, "-v"], n=2, env=emulator.key_env())
    assert verbose.returncode == 0, verbose.output
    said = [line for line in verbose.stderr.splitlines() if line.startswith("azcp-cluster: credential: ")]
    assert said == ["azcp-cluster: credential: AZURE_STORAGE_ACCOUNT/AZURE_STORAGE_KEY (shared_key)"], verbose.stderr
    assert azurite.ACCOUNT_KEY not in verbose.output
    plain = run_cli(args, n=2, env=emulator.key_env())
    assert plain.returncode == 0 and "credential:" not in plain.stderr, plain.output
