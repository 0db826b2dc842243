"""A huge directory listed in key ranges (bloblist.py, keyspace.py), against the real emulator.

The emulator ignores List Blobs' ``startFrom``; the fault proxy serves it in front of it
(``start_from=True``), so the ranges are cut, listed at once and cut again on the emulator's
own pages. Without the proxy's help the listing must notice and list page after page.
"""

from __future__ import annotations

import time
import uuid

import pytest

from azcp_cluster.azure import bloblist, blobrest
from azcp_cluster.azure.credentials import Authorizer, resolve_credential
from azcp_cluster.azure.listing import list_with_sdk
from azcp_cluster.core.config import Config
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.faultproxy import FaultProxy

NAMES = (
    [f"flat/sample-{i:05d}.bin" for i in range(0, 2400, 7)]  # numbered
    + [f"flat/{uuid.UUID(int=(i * 0x9E3779B97F4A7C15_F39CC0605CEDC834) % 2**128).hex}" for i in range(120)]  # hex
    + ["flat/Zeta", "flat/a b", "flat/é.txt", "flat/~tilde", "flat/sub/deeper/x", "flat/sample-00001.bin.old"]
)


@pytest.fixture(scope="module")
def container(emulator: azurite.Emulator) -> str:
    name = "ranges" + uuid.uuid4().hex[:12]
    azurite.upload(emulator, name, {n: n.encode()[: i % 9] for i, n in enumerate(NAMES)})
    return name


def _lean(url: str, key_env: dict[str, str]) -> object:
    source = parse_blob_url(url)
    auth = Authorizer(source, resolve_credential(source, key_env, "auto"), time.time)
    return bloblist.list_blobs(source, auth, Config(source=url, dest="/tmp/unused"))


def _count_fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record each time a key-range listing gives up for page after page (OutOfOrder)."""
    seen: list[int] = []

    class Counted(blobrest.OutOfOrder):
        def __init__(self) -> None:
            seen.append(1)
            super().__init__()

    monkeypatch.setattr(blobrest, "OutOfOrder", Counted)
    return seen


def _sdk(emulator: azurite.Emulator, url: str) -> object:
    source = parse_blob_url(url)
    auth = Authorizer(source, resolve_credential(source, emulator.key_env(), "auto"), time.time)
    return list_with_sdk(source, auth, Config(source=url, dest="/tmp/unused"))


@pytest.mark.parametrize("prefix", ["", "flat", "flat/"])
def test_a_huge_directory_in_key_ranges_is_the_sdks_listing(
    emulator: azurite.Emulator, container: str, monkeypatch: pytest.MonkeyPatch, prefix: str
) -> None:
    monkeypatch.setattr(blobrest, "PAGE", 20)  # 480 blobs: 24 pages in one go, many ranges here
    monkeypatch.setattr(blobrest, "SPLIT", 6)
    fallbacks = _count_fallbacks(monkeypatch)
    with FaultProxy(emulator, [], start_from=True) as proxy:
        lean = _lean(proxy.url(container, prefix), emulator.key_env())
    assert lean == _sdk(emulator, emulator.url(container, prefix)) and fallbacks == []
    assert len(lean.files) == len(NAMES)  # type: ignore[attr-defined]
    # The probe, then ranges; ranges cut again (more than one split's worth).
    assert len(proxy.started_from) > 6 + 1 and proxy.errors == []


def test_a_service_that_ignores_start_from_is_listed_page_after_page(
    emulator: azurite.Emulator, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobrest, "PAGE", 20)
    with FaultProxy(emulator, []) as proxy:  # startFrom reaches the emulator, which ignores it
        lean = _lean(proxy.url(container, "flat/"), emulator.key_env())
    assert lean == _sdk(emulator, emulator.url(container, "flat/"))
    assert len(proxy.started_from) == 1  # the probe only


def test_a_directory_of_one_page_is_never_cut(
    emulator: azurite.Emulator, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FaultProxy(emulator, [], start_from=True) as proxy:
        lean = _lean(proxy.url(container, "flat/"), emulator.key_env())
    assert len(lean.files) == len(NAMES) and proxy.started_from == []  # type: ignore[attr-defined]


def test_names_the_service_orders_by_utf16_code_unit_are_all_listed(
    emulator: azurite.Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # U+FF01 sorts after U+1F600 by UTF-16 code unit (the emulator's order, and Azure's), but
    # before it by code point: pieces compared in Python's order would drop one or the other.
    container = "utf16" + uuid.uuid4().hex[:12]
    names = [f"d/\U0001f600{i:04d}" for i in range(90)] + [f"d/\uff01{i}" for i in range(10)] + ["d/\uffee"]
    azurite.upload(emulator, container, {n: b"u" for n in names})
    monkeypatch.setattr(blobrest, "PAGE", 10)
    monkeypatch.setattr(blobrest, "SPLIT", 4)
    fallbacks = _count_fallbacks(monkeypatch)
    with FaultProxy(emulator, [], start_from=True) as proxy:
        lean = _lean(proxy.url(container, "d/"), emulator.key_env())
    assert lean == _sdk(emulator, emulator.url(container, "d/")) and len(lean.files) == len(names)  # type: ignore[attr-defined]
    # In key ranges all the way: the pages were in the order the pieces assume.
    assert len(proxy.started_from) > 1 and fallbacks == []


def test_a_service_that_stops_taking_start_from_is_listed_again_page_after_page(
    emulator: azurite.Emulator, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobrest, "PAGE", 20)
    monkeypatch.setattr(blobrest, "SPLIT", 6)
    fallbacks = _count_fallbacks(monkeypatch)
    with FaultProxy(emulator, [], start_from=True, start_from_served=3) as proxy:  # the probe and two ranges
        lean = _lean(proxy.url(container, "flat/"), emulator.key_env())
    assert lean == _sdk(emulator, emulator.url(container, "flat/"))
    assert len(proxy.started_from) > 3 and proxy.errors == [] and fallbacks


def test_a_name_no_piece_keeps_makes_the_directory_be_listed_again(
    emulator: azurite.Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pieces compare names in another order than the service's (code points against
    # UTF-16 units) and no page looks out of order to them (ascending() says yes): a range
    # that starts before its cut, or a name read by a piece and kept by none, must send the
    # listing back to page after page. (With the page checks removed by hand, this passes
    # through the kept-names check alone, and fails without it.)
    container = "net" + uuid.uuid4().hex[:12]
    # The last page, in the service's order, is 😀0090..😀0094 then ！0..！4: no page goes back.
    names = [f"d/\U0001f600{i:04d}" for i in range(95)] + [f"d/\uff01{i}" for i in range(5)]
    azurite.upload(emulator, container, {n: b"n" for n in names})
    monkeypatch.setattr(blobrest, "PAGE", 10)
    monkeypatch.setattr(blobrest, "SPLIT", 4)
    monkeypatch.setattr(blobrest, "order", lambda name: name.encode("utf-32-be"))
    monkeypatch.setattr(blobrest, "ascending", lambda names: True)
    monkeypatch.setattr(blobrest, "in_piece", lambda n, lo, hi: (lo is None or n > lo) and (hi is None or n <= hi))
    import azcp_cluster.core.keyspace as keyspace

    monkeypatch.setattr(keyspace, "order", lambda name: name.encode("utf-32-be"))
    with FaultProxy(emulator, [], start_from=True) as proxy:
        lean = _lean(proxy.url(container, "d/"), emulator.key_env())
    assert lean == _sdk(emulator, emulator.url(container, "d/")) and len(lean.files) == len(names)  # type: ignore[attr-defined]
    assert len(proxy.started_from) > 1
