"""Second hostile review of issue 38 (after the fixes of 849a7b8): the range MD5 gate, the journal's
source flag, the composition of --verify's source CRC. Real runs: Azurite, ``mpiexec``."""

from __future__ import annotations

import base64
import hashlib
import uuid
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import run_cli, tree_of


def _dataset_with_stored_md5(
    emulator: azurite.Emulator, sizes: dict[str, int], stored: str
) -> tuple[str, dict[str, bytes]]:
    """Blobs under d/ whose Content-MD5 *property* is ``stored`` (Set Blob Properties takes any
    value; the service never checks it against the bytes: a stale or wrong one is common)."""
    from azure.storage.blob import ContentSettings

    container = "rw" + uuid.uuid4().hex[:16]
    files = {name: pseudo_random(size, f"{container}/{name}") for name, size in sizes.items()}
    azurite.upload(emulator, container, {f"d/{name}": data for name, data in files.items()})
    client = azurite.container_client(emulator, container, create=False)
    for name in files:
        client.get_blob_client(f"d/{name}").set_http_headers(
            ContentSettings(content_type="application/octet-stream", content_md5=bytearray(base64.b64decode(stored)))
        )
    return container, files


WRONG_MD5 = base64.b64encode(hashlib.md5(b"not these bytes").digest()).decode()


@pytest.mark.parametrize(
    "size",
    [
        MiB,  # the whole blob in one range: no range MD5 is asked (the service answers with the stored one)
        6 * MiB,  # ranges of 1 MiB inside the blob: the service's MD5 of each range
    ],
)
def test_a_blob_with_a_stale_content_md5_property_copies_without_verify(
    emulator: azurite.Emulator, tmp_path: Path, size: int
) -> None:
    """A healthy run (no --verify) of a blob whose stored Content-MD5 property is not its bytes'
    must copy it: the range MD5 asked over plain HTTP is the service's MD5 *of the range*."""
    container, files = _dataset_with_stored_md5(emulator, {"a.bin": size}, WRONG_MD5)
    result = run_cli([emulator.url(container, "d"), str(tmp_path / "{rank}"), "--no-progress",
                      "--block-size", "1MiB"], n=1,
                     env=emulator.key_env(), json_path=tmp_path / "r.json")  # fmt: skip
    assert result.returncode == 0, result.output
    assert tree_of(tmp_path / "0") == files


def _plain_dataset(emulator: azurite.Emulator, sizes: dict[str, int]) -> tuple[str, dict[str, bytes]]:
    container = "rw" + uuid.uuid4().hex[:16]
    files = {name: pseudo_random(size, f"{container}/{name}") for name, size in sizes.items()}
    azurite.upload(emulator, container, {f"d/{name}": data for name, data in files.items()})
    return container, files


def test_flips_under_workers_pacing_and_streaming_are_asked_again(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """Sound today (control): the range-MD5 gate with --download-workers processes, --max-bandwidth
    pacing and streamed landings on 2 nodes: three hops' flips in ranges of 2 MiB, no --verify;
    every one asked again, nothing wrong lands, exit 0."""
    from azcp_cluster.devtools.faultproxy import FaultProxy, Rule

    sizes = {f"p{i}.bin": 6 * MiB + 4096 * i for i in range(3)}
    container, files = _plain_dataset(emulator, sizes)
    rules = [Rule("flip", blob=f"d/p{i}.bin", nth=2, partial=12345 * (i + 1)) for i in range(3)]
    with FaultProxy(emulator, rules) as proxy:
        result = run_cli(
            [proxy.url(container, "d"), str(tmp_path / "{rank}"), "--block-size", "2MiB", "--no-progress",
             "--download-workers", "2", "--max-bandwidth", "400MiB/s"],
            n=2, env=emulator.key_env(), json_path=tmp_path / "r.json",
        )  # fmt: skip
    assert proxy.injected == 3, result.output
    assert result.returncode == 0, result.output
    for rank in range(2):
        assert tree_of(tmp_path / str(rank)) == {k: v for k, v in files.items()}, f"node {rank}"
    assert "wrong Content-MD5=3" in result.stdout, result.stdout


def _no_md5_dataset(emulator: azurite.Emulator, sizes: dict[str, int]) -> tuple[str, dict[str, bytes]]:
    from azure.storage.blob import ContentSettings

    container, files = _plain_dataset(emulator, sizes)
    client = azurite.container_client(emulator, container, create=False)
    for name in files:
        client.get_blob_client(f"d/{name}").set_http_headers(ContentSettings(content_type="application/octet-stream"))
    assert not any(b.content_settings.content_md5 for b in client.list_blobs())
    return container, files


class _FlippingTLSHop:
    """A TLS-terminating hop (TLS to the client with its own certificate, plain HTTP to the
    emulator) that inverts one body byte of the first ranged GET of ``blob``."""

    def __init__(self, emulator: azurite.Emulator, cert: Path, key: Path, blob: str, at: int) -> None:
        import socket
        import ssl
        import threading

        self.upstream = (emulator.host, emulator.port)
        self.blob, self.at, self.flipped = blob, at, 0
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(str(cert), str(key))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, container: str, prefix: str) -> str:
        return f"https://127.0.0.1:{self.port}/{azurite.ACCOUNT}/{container}/{prefix}"

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _head(f) -> bytes:
        lines = b""
        while True:
            line = f.readline()
            if not line:
                return b""
            lines += line
            if line in (b"\r\n", b"\n"):
                return lines

    def _serve(self, raw) -> None:
        """One request per connection, each on a new upstream connection asked to close: the
        answer is read to its end, changed if picked, and relayed; then both close."""
        import socket

        try:
            tls = self.ctx.wrap_socket(raw, server_side=True)
            req = self._head(tls.makefile("rb"))
            if not req:
                return
            req = req[:-2] + b"Connection: close\r\n\r\n"
            up = socket.create_connection(self.upstream)
            up.sendall(req)
            answer = b""
            while chunk := up.recv(1 << 20):
                answer += chunk
            up.close()
            method, target = req.split(b" ")[:2]
            ranged = b"\r\nrange:" in req.lower()
            with self.lock:
                flip = method == b"GET" and ranged and self.blob.encode() in target and not self.flipped
                self.flipped += flip
            if flip:
                at = answer.index(b"\r\n\r\n") + 4 + self.at
                answer = answer[:at] + bytes([answer[at] ^ 0xFF]) + answer[at + 1 :]
            tls.sendall(answer)
            tls.close()
        except OSError:
            return

    def close(self) -> None:
        self.sock.close()


@pytest.mark.xfail(
    strict=True,
    reason="a known limit (docs/reliability.md, 'Where a byte is checked'): a TLS peer the tool trusts vouches "
    "for the bytes; over HTTPS no range MD5 is asked (1.5 s of a core per GiB), so a hop that ends TLS and "
    "changes a byte is found only against a Content-MD5",
)
def test_a_tls_terminating_hop_that_flips_a_byte_fails_verify(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """A TLS-terminating hop (a corporate TLS-inspection proxy, a TLS-offloading gateway, with its CA
    in REQUESTS_CA_BUNDLE, which the tool supports) flips one body byte of a 1 MiB ranged GET, then
    re-encrypts it: TLS authenticates the hop's bytes, not the service's. The fix asks the range
    MD5 only over plain HTTP (downloader._get_once: ``self._tls is None``), so the flipped byte
    lands, its CRC is the "source's", and with no Content-MD5 --verify passes: exit 0, wrong bytes.
    The documented exception is plain HTTP ranges over 4 MiB only."""
    from azcp_cluster.devtools.certs import make_certificate

    cert, key = make_certificate(tmp_path)
    container, files = _no_md5_dataset(emulator, {"a.bin": MiB})
    env = {**emulator.key_env(), "REQUESTS_CA_BUNDLE": str(cert), "SSL_CERT_FILE": str(cert)}
    hop = _FlippingTLSHop(emulator, cert, key, "d/a.bin", 1000)
    try:
        result = run_cli(
            [hop.url(container, "d"), str(tmp_path / "{rank}"), "--block-size", "1MiB", "--no-progress", "--verify"],
            n=1, env=env, json_path=tmp_path / "r.json",
        )  # fmt: skip
    finally:
        hop.close()
    assert hop.flipped == 1, result.output
    wrong = tree_of(tmp_path / "0").get("a.bin") != files["a.bin"]
    assert not (result.returncode == 0 and wrong), f"exit 0 with wrong bytes\n{result.output}"


def test_a_verified_rerun_at_another_block_size_from_two_nodes_source_claims(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    """Sound today (control for core.crc.disagree's false positives): run 1 (--no-overlap, 1 MiB
    blocks) stopped by SIGTERM between the download and the fan-out, each node holding only the
    blocks it downloaded (source claims); the rerun with --verify at 3 MiB blocks keeps both
    nodes' claims, sends each to the other, composes the source CRC from both: exit 0, nothing
    flagged as disagreeing, every copy right."""
    sizes = {"a.bin": 7 * MiB + 5, "b.bin": 5 * MiB}
    container, files = _no_md5_dataset(emulator, sizes)
    base = tmp_path / "d"
    program = [str(Path(__file__).parent / "programs" / "signal_at.py")]
    env = {
        **emulator.key_env(),
        "AZCP_SIGNAL_AT": "azcp_cluster.stages.transfer:fan_out",
        "AZCP_SIGNAL_WHEN": "before",
        "AZCP_SIGNAL": "TERM",
    }
    opts = ["--no-overlap", "--no-progress", "--shard-size", "1MiB"]
    first = run_cli([emulator.url(container, "d"), str(base / "{rank}"), *opts, "--block-size", "1MiB"], n=2,
                    env=env, program=program)  # fmt: skip
    assert first.returncode != 0, first.output
    rerun = run_cli([emulator.url(container, "d"), str(base / "{rank}"), "--no-progress", "--verify",
                     "--block-size", "3MiB"], n=2, env=emulator.key_env(), json_path=tmp_path / "r.json")  # fmt: skip
    assert rerun.returncode == 0, rerun.output
    assert rerun.json is not None and rerun.json["resumed_files"] >= 1, rerun.output
    for rank in range(2):
        assert tree_of(base / str(rank)) == files, f"node {rank}"
