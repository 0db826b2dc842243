"""The lean listing on every tree shape (bloblist.py): one request where one flat page holds it
all, the SDK's listing on every shape, and the first page's whole directories never listed again.

Against the real emulator; the fault proxy in front of it counts the requests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.azure import bloblist, blobrest
from azcp_cluster.azure.bloblist import FirstPage
from azcp_cluster.azure.credentials import Authorizer, resolve_credential
from azcp_cluster.azure.listing import list_with_sdk
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import ListError
from azcp_cluster.core.model import Listing
from azcp_cluster.core.naming import RawEntry
from azcp_cluster.core.source import BlobSource, parse_blob_url
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.certs import make_certificate
from azcp_cluster.devtools.faultproxy import FaultProxy
from tests.conftest import assert_copies, clean_env, mpiexec_path, run_cli
from tests.test_bloblist import counted_listings

BLOBS = 120


def _deep(i: int) -> str:
    """Eight levels, two ways at each: 256 leaf directories."""
    return "/".join(f"l{k}{(i >> k) & 1}" for k in range(8)) + f"/f{i:04d}"


SHAPES = {
    "flat": [f"f{i:04d}" for i in range(BLOBS)],
    "25 directories": [f"d{i % 25:02d}/f{i:04d}" for i in range(BLOBS)],
    "a directory each": [f"d{i:04d}/f{i:04d}" for i in range(BLOBS)],
    "8 levels deep": [_deep(i) for i in range(BLOBS)],
    "one directory": [f"train/part-{i % 10:02d}/s{i:04d}" for i in range(BLOBS)],
    "mixed": [f"top{i}" for i in range(5)] + [f"d{i % 7}/{'s/' * (i % 4)}f{i:04d}" for i in range(BLOBS - 5)],
}


@pytest.fixture(scope="module")
def containers(emulator: azurite.Emulator) -> dict[str, str]:
    made = {}
    for shape, names in SHAPES.items():
        made[shape] = "shape" + uuid.uuid4().hex[:12]
        azurite.upload(emulator, made[shape], {n: n.encode()[: i % 11] for i, n in enumerate(names)})
    return made


def _auth(url: str, key_env: dict[str, str]) -> tuple[BlobSource, Authorizer, Config]:
    source = parse_blob_url(url)
    auth = Authorizer(source, resolve_credential(source, key_env, "auto"), time.time)
    return source, auth, Config(source=url, dest="/tmp/unused")


def _lean(url: str, key_env: dict[str, str]) -> Listing:
    return bloblist.list_blobs(*_auth(url, key_env))


def _sdk(url: str, key_env: dict[str, str]) -> Listing:
    return list_with_sdk(*_auth(url, key_env))


@pytest.mark.parametrize("shape", SHAPES)
def test_a_listing_that_fits_one_flat_page_is_one_request(
    emulator: azurite.Emulator, containers: dict[str, str], shape: str
) -> None:
    with FaultProxy(emulator, []) as proxy:
        lean = _lean(proxy.url(containers[shape]), emulator.key_env())
    assert lean == _sdk(emulator.url(containers[shape]), emulator.key_env())
    assert len(lean.files) == len(SHAPES[shape])
    assert [(seen.method, seen.blob) for seen in proxy.log] == [("GET", "")], proxy.log


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("page", [4, 25, 50])
def test_every_shape_lists_as_the_sdk_over_many_pages(
    emulator: azurite.Emulator, containers: dict[str, str], monkeypatch: pytest.MonkeyPatch, shape: str, page: int
) -> None:
    # Pages smaller than the listing: the first flat page, then the descent, the probes, the
    # levels and the flat listings, with the first page's whole directories taken from it.
    monkeypatch.setattr(blobrest, "PAGE", page)
    monkeypatch.setattr(bloblist, "PROBE", 3)
    url = emulator.url(containers[shape])
    assert _lean(url, emulator.key_env()) == _sdk(url, emulator.key_env())


@pytest.mark.parametrize("prefix", ["d0", "d1/", "d1/s", "d2/s/s/"])
def test_a_prefix_lists_as_the_sdk(
    emulator: azurite.Emulator, containers: dict[str, str], monkeypatch: pytest.MonkeyPatch, prefix: str
) -> None:
    url = emulator.url(containers["mixed"], prefix)
    assert _lean(url, emulator.key_env()) == _sdk(url, emulator.key_env())
    monkeypatch.setattr(blobrest, "PAGE", 3)
    assert _lean(url, emulator.key_env()) == _sdk(url, emulator.key_env())


def test_the_first_pages_whole_directories_are_not_listed_again(
    emulator: azurite.Emulator, containers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 25 directories of 5 blobs (d00/ to d19/) or 4, pages of 22: the first page holds d00/
    # to d03/ whole and the start of d04/ (its last name). Only d04/ onwards are listed again.
    monkeypatch.setattr(blobrest, "PAGE", 22)
    calls = counted_listings(monkeypatch)
    url = emulator.url(containers["25 directories"])
    assert _lean(url, emulator.key_env()) == _sdk(url, emulator.key_env())
    assert calls[:2] == [("", ""), ("", "/")]  # the first flat page, then the top's directories
    listed = {prefix for prefix, _ in calls[2:]}
    assert listed == {f"d{d:02d}/" for d in range(4, 25)}, calls


def test_a_directory_the_first_page_shows_big_is_not_probed(
    emulator: azurite.Emulator, containers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # train/ alone at the top, 120 blobs in 10 directories of 12, pages of 50: the first page
    # is all train/, more than a probe's worth, so train/ goes a level down at once; and
    # part-00/ to part-03/ are whole on it.
    monkeypatch.setattr(blobrest, "PAGE", 50)
    monkeypatch.setattr(bloblist, "PROBE", 3)
    calls = counted_listings(monkeypatch)
    url = emulator.url(containers["one directory"])
    assert _lean(url, emulator.key_env()) == _sdk(url, emulator.key_env())
    assert ("train/", "") not in calls and ("train/", "/") in calls
    assert not any(prefix.startswith(f"train/part-0{d}/") for prefix, _ in calls for d in range(4)), calls


def test_four_ranks_list_one_flat_page_with_one_request(emulator: azurite.Emulator, tmp_path: Path) -> None:
    container = "onepage" + uuid.uuid4().hex[:12]
    files = {f"d{i % 25:02d}/f{i:03d}": f"{i}".encode() for i in range(100)}
    azurite.upload(emulator, container, files)
    with FaultProxy(emulator, []) as proxy:
        result = run_cli([proxy.url(container), str(tmp_path / "d" / "{rank}"), "--no-progress", "--dry-run"],
                         env=emulator.key_env())  # fmt: skip
    assert result.returncode == 0, result.output
    container_calls = [seen for seen in proxy.log if not seen.blob]
    assert [seen.method for seen in container_calls] == ["GET"], proxy.log
    run = run_cli([emulator.url(container), str(tmp_path / "d" / "{rank}"), "--no-progress"], env=emulator.key_env())
    assert run.returncode == 0, run.output
    assert_copies(tmp_path / "d", files)


# -- FirstPage, exhaustively and by property --------------------------------------------------


def _entries(names: list[str]) -> list[RawEntry]:
    return [RawEntry(name=n, size=0, etag="", last_modified=0.0) for n in names]


def test_a_directory_is_complete_when_the_pages_last_name_is_not_in_it() -> None:
    page = FirstPage.of("", _entries(["a/1", "a/2", "b/c/1", "b/d/1", "b/d/2", "top"]))
    assert page.complete("a/") and page.complete("b/") and page.complete("b/c/") and page.complete("b/d/")
    page = FirstPage.of("", _entries(["a/1", "b/c/1", "b/d/1"]))
    assert page.complete("a/") and page.complete("b/c/")
    assert not page.complete("b/") and not page.complete("b/d/")  # the last name's: more may follow
    assert not page.complete("c/")  # not on the page at all
    kept, left = page.take(["a/", "b/", "c/"])
    assert [e.name for e in kept] == ["a/1"] and left == ["b/", "c/"]
    kept, left = page.take(["b/c/", "b/d/"])
    assert [e.name for e in kept] == ["b/c/1"] and left == ["b/d/"]


def test_a_directory_with_more_than_a_probe_on_the_page_is_big(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bloblist, "PROBE", 3)
    page = FirstPage.of("p/", _entries(["p/a/1", "p/a/2", "p/a/3", "p/a/4", "p/b/1"]))
    assert page.big("p/a/") and not page.big("p/b/") and not page.big("p/c/")
    assert "p/" not in page.counts  # the prefix itself is no directory below it
    assert not FirstPage.of("p/", _entries(["p/x", "p/y"])).counts  # blobs only: one flat directory


_segment = st.sampled_from(["a", "b", "c", "a-b", "a.b"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(_segment, min_size=1, max_size=4).map("/".join), min_size=2, max_size=40, unique=True),
    st.data(),
)
def test_the_page_and_the_directories_left_list_every_blob_once(names: list[str], data: st.DataObject) -> None:
    # Any tree, any first page (a proper start of the listing, in name order), any level of its
    # directories: the page's blobs below the complete ones, with the blobs below the others,
    # are the level's blobs, each once; and a complete directory has every blob on the page.
    names = sorted(names)  # a blob "a" and blobs below "a/" may both be there
    cut = data.draw(st.integers(1, len(names) - 1))
    page = FirstPage.of("", _entries(names[:cut]))
    depth = data.draw(st.integers(1, 3))
    folders = sorted({"/".join(n.split("/")[:depth]) + "/" for n in names if n.count("/") >= depth})
    kept, left = page.take(folders)
    below_left = [n for n in names if any(n.startswith(f) for f in left)]
    below_all = [n for n in names if any(n.startswith(f) for f in folders)]
    assert sorted([e.name for e in kept] + below_left) == below_all
    for folder in set(folders) - set(left):
        assert all(n in names[:cut] for n in names if n.startswith(folder))


# -- the first requests through the standard library ----------------------------------------

IMPORTS = textwrap.dedent(
    """
    import sys, time
    from azcp_cluster.azure import bloblist, blobrest
    from azcp_cluster.core.config import Config
    from azcp_cluster.azure.credentials import Authorizer, resolve_credential
    from azcp_cluster.core.source import parse_blob_url

    url, page = sys.argv[1], int(sys.argv[2])
    if page:
        blobrest.PAGE = page
    source = parse_blob_url(url)
    auth = Authorizer(source, resolve_credential(source, {KEY}, "auto"), time.time)
    listing = bloblist.list_blobs(source, auth, Config(source=url, dest="/tmp/unused"))
    print(len(listing.files), "aiohttp" in sys.modules)
    """
)


@pytest.mark.parametrize(("page", "imported"), [(0, False), (7, True)])
def test_a_listing_of_one_page_never_imports_aiohttp(
    emulator: azurite.Emulator, containers: dict[str, str], page: int, imported: bool
) -> None:
    # 0.12 s of the lister's CPU: a third of a no-op rerun of a thousand blobs. A listing of
    # more than a page lists the rest several requests at once, through aiohttp.
    script = IMPORTS.replace("{KEY}", repr(emulator.key_env()))
    url = emulator.url(containers["25 directories"])
    out = subprocess.run([sys.executable, "-c", script, url, str(page)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(BLOBS), str(imported)], out.stderr


def test_a_dropped_connection_on_the_first_page_is_retried(
    emulator: azurite.Emulator, containers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    failed: list[str] = []
    original = blobrest.Plain.request

    def drops_once(self: blobrest.Plain, method: str, url: str, headers: dict[str, str]) -> tuple:  # type: ignore[type-arg]
        if not failed:
            failed.append(url)
            self.close()
            raise ConnectionResetError(104, "Connection reset by peer")
        return original(self, method, url, headers)

    monkeypatch.setattr(blobrest.Plain, "request", drops_once)
    monkeypatch.setattr("azcp_cluster.core.retry.backoff_delay", lambda *args: 0.0)
    url = emulator.url(containers["mixed"])
    assert _lean(url, emulator.key_env()) == _sdk(url, emulator.key_env()) and failed


def test_an_endpoint_nobody_answers_is_named(emulator: azurite.Emulator) -> None:
    url = f"http://127.0.0.1:{azurite.free_port()}/{azurite.ACCOUNT}/nobody"
    source, auth, _ = _auth(url, emulator.key_env())
    with pytest.raises(
        ListError, match=r"cannot reach 127\.0\.0\.1:\d+ \(http://127\.0\.0\.1:\d+/\w+\): connection refused$"
    ):
        bloblist.list_blobs(source, auth, Config(source=url, dest="/tmp/unused", max_retries=0))


@pytest.fixture(scope="module")
def https_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[azurite.Emulator]:
    cert, key = make_certificate(tmp_path_factory.mktemp("tls"))
    with azurite.running(cert=str(cert), key=str(key)) as emu:
        azurite.upload(emu, "tls", {name: b"t" for name in SHAPES["mixed"]})
        yield emu


@pytest.mark.parametrize("page", [5000, 7])
def test_the_listing_over_https_trusts_the_bundle_and_checks_the_name(
    https_emulator: azurite.Emulator, monkeypatch: pytest.MonkeyPatch, page: int
) -> None:
    # One page: the standard library's client; more: aiohttp's after it. Both trust the
    # bundle named (tls.py), and without it the system's authorities only.
    assert https_emulator.ca_file is not None
    monkeypatch.setattr(blobrest, "PAGE", page)
    url = https_emulator.url("tls")
    for name in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.setenv(name, https_emulator.ca_file)
    assert len(_lean(url, https_emulator.key_env()).files) == BLOBS
    for name in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.delenv(name)
    source, auth, _ = _auth(url, https_emulator.key_env())
    with pytest.raises(ListError, match=r"cannot reach [\d.]+:\d+ \(https://.*\): TLS: .*certificate"):
        bloblist.list_blobs(source, auth, Config(source=url, dest="/tmp/unused", max_retries=0))


def _ranks_listing(container: str) -> list[int]:
    """The pids of the ranks (not the launcher) whose command line names ``container``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        launcher = any(name in cmdline[0] for name in (b"mpiexec", b"mpirun", b"prterun"))
        if not launcher and b"azcp_cluster" in cmdline and any(container.encode() in arg for arg in cmdline):
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_first_page_is_awaited_stops_the_run_at_once(
    emulator: azurite.Emulator, tmp_path: Path, signum: int, code: int
) -> None:
    # The first page is read by a blocking http.client call: a server that never answers
    # keeps it waiting, and the signal (to every rank, as Slurm sends it) must still end the
    # run at once, with its one line.
    container = "silent" + uuid.uuid4().hex[:12]
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(60)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/{azurite.ACCOUNT}/{container}"
        cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "azcp_cluster", url, str(tmp_path / "{rank}"),
               "--no-progress"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=clean_env(emulator.key_env()), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            conn, _ = silent.accept()  # the listing's request is on its way
            with conn:
                time.sleep(0.5)
                pids = _ranks_listing(container)
                assert len(pids) == 2, pids
                sent = time.monotonic()
                for pid in pids:
                    os.kill(pid, signum)
                _, err = proc.communicate(timeout=60)
                took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    errors = [line for line in err.splitlines() if line.startswith("azcp-cluster: error")]
    assert proc.returncode == code and len(errors) == 1 and "interrupted" in errors[0], err
    assert took < 10, took
