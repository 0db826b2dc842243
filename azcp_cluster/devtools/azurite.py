"""Start and stop the Azure Storage emulator (Azurite, pinned in package.json) on loopback."""

from __future__ import annotations

import datetime as _dt
import http.client
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from azcp_cluster.azure.credentials import container_sas

# The emulator's documented, well-known development account: not a secret.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Emulator:
    """A running emulator: where it listens and how to reach its account."""

    host: str
    port: int
    pid: int
    scheme: str = "http"
    # HTTPS: the PEM certificate clients must trust (the emulator's own, self-signed).
    ca_file: str | None = None

    @property
    def endpoint(self) -> str:
        """Path-style service URL of the development account."""
        return f"{self.scheme}://{self.host}:{self.port}/{ACCOUNT}"

    def url(self, container: str, prefix: str = "") -> str:
        """SOURCE URL for a container and prefix."""
        return f"{self.endpoint}/{container}" + (f"/{prefix}" if prefix else "")

    @property
    def connection_string(self) -> str:
        """Connection string for the development account on this emulator."""
        return (
            f"DefaultEndpointsProtocol={self.scheme};AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def key_env(self) -> dict[str, str]:
        """Environment that authenticates with the account key (as a user would)."""
        return {"AZURE_STORAGE_ACCOUNT": ACCOUNT, "AZURE_STORAGE_KEY": ACCOUNT_KEY}


def find_binary(root: Path = REPO_ROOT) -> str:
    """Path of ``azurite-blob`` from the project's node_modules (``npm ci`` installs it)."""
    local = root / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    found = shutil.which("azurite-blob")
    if found:
        return found
    raise FileNotFoundError("azurite-blob not found: run `npm ci` in the repository root")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"azurite exited early with status {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"azurite did not listen on {host}:{port} within {timeout}s")


@contextmanager
def running(
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
    cpus: set[int] | None = None,
    cert: str | None = None,
    key: str | None = None,
    oauth: str | None = None,
    location: str | None = None,
    wrap: tuple[str, ...] = (),
    leave_running: bool = False,
) -> Iterator[Emulator]:
    """Run an in-memory emulator for the duration of the block; stop it by PID afterwards.

    ``location`` (a directory) keeps the emulator's database and blobs there instead of in
    memory, so a later emulator on the same directory serves them again. ``wrap`` goes before
    the command and must exec it (``ip netns exec NS``: the emulator in a network namespace).
    ``leave_running`` leaves the emulator serving after a block that ends normally (it runs in a
    session of its own: ``kill PID`` stops it); a block that raises stops it all the same.

    ``cpus`` pins the emulator (and every thread it starts) to those CPUs, so a benchmark can
    keep the server off the cores it measures the client on. ``cert`` and ``key`` (PEM
    files) serve HTTPS instead of HTTP; ``oauth="basic"`` also accepts bearer tokens (HTTPS
    only; Azurite checks their audience, issuer and lifetime, not their signature).
    """
    if (cert is None) != (key is None):
        raise ValueError("cert and key go together")
    if oauth is not None and cert is None:
        raise ValueError("the emulator takes OAuth tokens over HTTPS only: pass cert and key")
    port = port or free_port(host)
    pin = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
    tls = ("--cert", cert, "--key", key) if cert is not None and key is not None else ()
    args = [
        *wrap,
        *pin,
        find_binary(),
        *(("--location", location) if location else ("--inMemoryPersistence",)),
        "--blobHost",
        host,
        "--blobPort",
        str(port),
        "--skipApiVersionCheck",
        "--loose",
        "--disableTelemetry",
        "--silent",
        *tls,
        *(("--oauth", oauth) if oauth else ()),
        *extra_args,
    ]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=dict(os.environ if env is None else env),
    )
    completed = False
    try:
        _wait_listening(host, port, proc, timeout=30)
        yield Emulator(host=host, port=port, pid=proc.pid, scheme="https" if cert else "http", ca_file=cert)
        completed = True
    finally:
        if proc.poll() is None and not (completed and leave_running):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def container_client(emulator: Emulator, container: str, create: bool = True):  # type: ignore[no-untyped-def]
    """An azure-storage-blob ContainerClient on the emulator (created if asked)."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    verify: str | bool = emulator.ca_file or True
    service = BlobServiceClient.from_connection_string(emulator.connection_string, connection_verify=verify)
    client = service.get_container_client(container)
    if create:
        with suppress(ResourceExistsError):
            client.create_container()
    return client


# Blobs up to this size go up in one plain PUT each, on a kept-alive connection; larger ones
# through the SDK (in blocks, four at a time).
SMALL_BLOB = 4 * 1024 * 1024
PUT_HEADERS = {"x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream"}  # as the SDK sends


def upload(emulator: Emulator, container: str, blobs: Mapping[str, bytes]) -> None:
    """Upload ``{name: data}`` into ``container`` (created if missing).

    The SDK spends some 7 ms of CPU on each request here, so a fixture of a thousand small
    blobs took 8 s: the small ones go up as plain Put Blob requests (a write SAS made from the
    key, one connection), the rest through the SDK."""
    client = container_client(emulator, container)
    small = {name: data for name, data in blobs.items() if _plain(name, data)}
    if small:
        _put_small(emulator, container, small)
    for name, data in blobs.items():
        if name not in small:
            client.upload_blob(name, data, overwrite=True, max_concurrency=4)


def _plain(name: str, data: bytes) -> bool:
    """Whether ``name`` goes up as a plain Put Blob: small, and no "." or ".." segment (the SDK's
    client resolves those in the URL, http.client would not: the name would depend on the size)."""
    return len(data) <= SMALL_BLOB and not {".", ".."} & set(name.split("/"))


def _put_small(emulator: Emulator, container: str, blobs: Mapping[str, bytes]) -> None:
    """Put Blob for each of ``blobs``, in order, on one kept-alive connection; a request that
    fails (a reset, a 500 or 503 of a busy emulator) is sent once more on a new connection."""
    start = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=15)
    sas = container_sas(ACCOUNT, container, ACCOUNT_KEY, "cw", start, start + _dt.timedelta(hours=2))

    def connect() -> http.client.HTTPConnection:
        if emulator.scheme == "https":
            context = ssl.create_default_context(cafile=emulator.ca_file)
            return http.client.HTTPSConnection(emulator.host, emulator.port, context=context, timeout=60)
        return http.client.HTTPConnection(emulator.host, emulator.port, timeout=60)

    conn = connect()
    try:
        for name, data in blobs.items():
            path = f"/{ACCOUNT}/{container}/{quote(name, safe='/~')}?{sas}"
            for attempt in (1, 2):
                try:
                    conn.request("PUT", path, body=data, headers=PUT_HEADERS)
                    response = conn.getresponse()
                    answer = response.read()
                except (OSError, http.client.HTTPException):
                    if attempt == 2:
                        raise
                    conn.close()
                    conn = connect()
                    continue
                if response.status == 201:
                    break
                if attempt == 2 or response.status not in (500, 503):
                    raise RuntimeError(f"the emulator refused {name!r}: {response.status} {answer[:300]!r}")
    finally:
        conn.close()


def delete(emulator: Emulator, container: str, names: Iterable[str]) -> None:
    """Delete the blobs ``names`` from ``container`` (e.g. from a fault proxy's hook, mid-copy)."""
    client = container_client(emulator, container, create=False)
    for name in names:
        client.delete_blob(name)
