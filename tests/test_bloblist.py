"""The lean listing (bloblist.py) gives what the SDK's listing gives, against the real emulator."""

from __future__ import annotations

import time
import uuid

import pytest

from azcp_cluster.azure.blobxml import parse_page
from azcp_cluster.azure.credentials import Authorizer, resolve_credential
from azcp_cluster.azure.listing import list_source, list_with_sdk
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import ListError
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.devtools import azurite

NAMES = [
    "top.bin",
    "ckpt/shard-00.bin",
    "ckpt/shard-01.bin",
    "ckpt/sub/deep/x.txt",
    "ckpt/ä ö/ü+%#&=.txt",  # spaces, non-ASCII and the characters a query string gives meaning to
    "ckpt/sub/y",
    "data/a/b/c/d/e.txt",
    "data/b.txt",
    "z/" + "n" * 200,
]


@pytest.fixture(scope="module")
def container(emulator: azurite.Emulator) -> str:
    name = "lean" + uuid.uuid4().hex[:12]
    azurite.upload(emulator, name, {n: f"content of {n}".encode() * (i + 1) for i, n in enumerate(NAMES)})
    client = azurite.container_client(emulator, name, create=False)
    # A directory marker (ADLS Gen2 style): listed, and skipped by the rules.
    client.upload_blob("ckpt/sub", b"", metadata={"hdi_isfolder": "true"}, overwrite=True)
    return name


def _both(emulator: azurite.Emulator, url: str, **options: object) -> tuple[object, object]:
    cfg = Config(source=url, dest="/tmp/unused", **options)  # type: ignore[arg-type]
    source = parse_blob_url(url)
    auth = Authorizer(source, resolve_credential(source, emulator.key_env(), "auto"), time.time)
    return list_source(source, auth, cfg), list_with_sdk(source, auth, cfg)


@pytest.mark.parametrize(
    ("prefix", "options"),
    [
        ("", {}),
        ("ckpt", {}),
        ("ckpt/", {}),
        ("ckpt/shard-00.bin", {}),  # one blob, named exactly
        ("ckpt/sub", {}),  # a marker named exactly: its directory is listed
        ("data", {"include": ("*.txt",), "exclude": ("a/*",)}),
        ("nothing-here", {}),
    ],
)
def test_the_lean_listing_is_the_sdks(emulator: azurite.Emulator, container: str, prefix: str, options: dict) -> None:  # type: ignore[type-arg]
    lean, sdk = _both(emulator, emulator.url(container, prefix), **options)
    assert lean == sdk
    assert lean.files or prefix == "nothing-here"  # type: ignore[attr-defined]


def test_a_listing_of_more_pages_than_one(emulator: azurite.Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    from azcp_cluster.azure import blobrest

    name = "pages" + uuid.uuid4().hex[:12]
    azurite.upload(emulator, name, {f"d{i % 3}/f{i:03d}": b"x" * i for i in range(45)} | {"root": b"r"})
    monkeypatch.setattr(blobrest, "PAGE", 7)  # markers followed, at the top and in every directory
    lean, sdk = _both(emulator, emulator.url(name))
    assert lean == sdk and len(lean.files) == 46  # type: ignore[attr-defined]


@pytest.mark.parametrize("levels", [0, 1, 10])
def test_the_listing_is_the_same_however_deep_it_descends(
    emulator: azurite.Emulator, container: str, monkeypatch: pytest.MonkeyPatch, levels: int
) -> None:
    # Down to every leaf directory with the delimiter, one level, or none (all flat from the
    # top's directories): the same listing, the SDK's; pages of two blobs, so the probes
    # find big directories, and their delimiter listings are continued from their markers.
    from azcp_cluster.azure import bloblist, blobrest

    monkeypatch.setattr(bloblist, "MAX_DESCENT", levels)
    monkeypatch.setattr(blobrest, "PAGE", 2)
    calls = counted_listings(monkeypatch)
    lean, sdk = _both(emulator, emulator.url(container))
    assert lean == sdk and len(lean.files) == len(NAMES)  # type: ignore[attr-defined]
    # The top's listing with the delimiter (its pages), then (levels > 0) levels down with it too.
    below = {prefix for prefix, delimiter in calls if delimiter == "/" and prefix}
    assert (not below) == (levels == 0), calls


def test_descend_while_the_directories_are_too_few_to_keep_the_listings_busy() -> None:
    from azcp_cluster.azure.bloblist import MAX_DESCENT, descend

    assert descend(1, 32, 0) and descend(31, 32, MAX_DESCENT - 1)
    assert not descend(32, 32, 0)  # enough to list flat, all at once
    assert not descend(0, 32, 0)  # nothing below
    assert not descend(1, 32, MAX_DESCENT)  # deep enough: a deep narrow tree is listed flat


def test_a_missing_container_and_a_wrong_key_are_named(emulator: azurite.Emulator) -> None:
    url = emulator.url("absent" + uuid.uuid4().hex[:8])
    source = parse_blob_url(url)
    auth = Authorizer(source, resolve_credential(source, emulator.key_env(), "auto"), time.time)
    with pytest.raises(ListError, match=r"container 'absent.*' not found at"):
        list_source(source, auth, Config(source=url, dest="/tmp/unused"))
    wrong = {**emulator.key_env(), "AZURE_STORAGE_KEY": "d3Jvbmc=" * 11}
    auth = Authorizer(source, resolve_credential(source, wrong, "auto"), time.time)
    with pytest.raises(ListError, match=r"access denied \(HTTP 403"):
        list_source(source, auth, Config(source=url, dest="/tmp/unused", max_retries=0))


def test_parse_page_reads_encoded_names_prefixes_and_the_marker() -> None:
    page = b"""<?xml version="1.0" encoding="utf-8"?>
<EnumerationResults ContainerName="c"><Blobs>
<Blob><Name Encoded="true">a%EF%BF%BEb</Name><Properties><Last-Modified>Tue, 01 Dec 2026 10:00:00 GMT</Last-Modified>
<Etag>0x8DB1</Etag><Content-Length>12</Content-Length><Content-MD5>q83vEjRWeJA=</Content-MD5></Properties></Blob>
<Blob><Name>dir</Name><Properties><Etag>"0x8DB2"</Etag><Content-Length>0</Content-Length></Properties>
<Metadata><hdi_isfolder>True</hdi_isfolder></Metadata></Blob>
<BlobPrefix><Name>dir/</Name></BlobPrefix>
</Blobs><NextMarker>2!ABC</NextMarker></EnumerationResults>"""
    entries, prefixes, marker = parse_page(page)
    assert [(e.name, e.size, e.etag, e.is_folder) for e in entries] == [
        ("a\ufffeb", 12, "0x8DB1", False),
        ("dir", 0, '"0x8DB2"', True),
    ]
    assert entries[0].content_md5 == "q83vEjRWeJA=" and entries[0].last_modified == 1796119200.0
    assert prefixes == ["dir/"] and marker == "2!ABC"


def counted_listings(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record the (prefix, delimiter) of every listing request of blobrest.Lister."""
    from azcp_cluster.azure import blobrest

    calls: list[tuple[str, str]] = []
    original = blobrest.Lister.everything

    async def counted(self: blobrest.Lister, prefix: str, delimiter: str = "", **more: int | str) -> tuple:  # type: ignore[type-arg]
        calls.append((prefix, delimiter))
        return await original(self, prefix, delimiter, **more)  # type: ignore[arg-type]

    monkeypatch.setattr(blobrest.Lister, "everything", counted)
    return calls
