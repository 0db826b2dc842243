"""Tests for the listing model and its compact wire form (azcp_cluster/core/model.py)."""

from __future__ import annotations

import json
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.model import FileEntry, Listing, decode_listing, encode_listing


def wire_doc(blob: bytes) -> dict[str, object]:
    doc = json.loads(zlib.decompress(blob).decode("utf-8"))
    assert isinstance(doc, dict)
    return doc


def test_round_trip_example_with_unicode_names() -> None:
    listing = Listing(
        files=(
            FileEntry(
                name="données/模型/🙂.bin",
                path="模型/🙂.bin",
                size=3,
                etag='"0x8DC"',
                content_md5="q0==",
                last_modified=1.5,
            ),
            FileEntry(name="a'b\"c\\d\ne\tf", path="a'b\"c\\d\ne\tf", size=0),
            FileEntry(name="ckpt/model-00001-of-00004.safetensors", path="model-00001-of-00004.safetensors", size=2**6),
        ),
        markers_skipped=4,
        filtered_out=2,
        dangling=("model", "sub/gone"),
        aliases=("a_alias",),
    )
    decoded = decode_listing(encode_listing(listing))
    assert decoded == listing
    assert decoded.files[0].name == "données/模型/🙂.bin"
    assert decoded.total_bytes == 3 + 2**6


def test_empty_listing_round_trips() -> None:
    assert decode_listing(encode_listing(Listing(files=()))) == Listing(files=())


def test_paths_equal_to_names_are_not_repeated_on_the_wire() -> None:
    listing = Listing(files=(FileEntry(name="x/a", path="x/a", size=1), FileEntry(name="p/b", path="b", size=2)))
    doc = wire_doc(encode_listing(listing))
    assert doc["path"] == [None, "b"]
    assert doc["name"] == ["x/a", "p/b"]
    assert doc["v"] == 1


def test_wire_form_is_compressed() -> None:
    files = tuple(
        FileEntry(name=f"ckpt/model-{i:05d}-of-01000.safetensors", path=f"model-{i:05d}-of-01000.safetensors", size=i)
        for i in range(1000)
    )
    blob = encode_listing(Listing(files=files))
    assert len(blob) < len(zlib.decompress(blob)) / 4


def test_unknown_version_is_refused() -> None:
    blob = encode_listing(Listing(files=(FileEntry(name="a", path="a", size=1),)))
    doc = wire_doc(blob)
    doc["v"] = 2
    with pytest.raises(ValueError, match="version"):
        decode_listing(zlib.compress(json.dumps(doc).encode()))


def test_columns_of_different_lengths_are_refused() -> None:
    doc = wire_doc(encode_listing(Listing(files=(FileEntry(name="a", path="a", size=1),))))
    doc["size"] = [1, 2]
    with pytest.raises(ValueError):
        decode_listing(zlib.compress(json.dumps(doc).encode()))


def test_total_bytes() -> None:
    assert Listing(files=()).total_bytes == 0
    assert Listing(files=(FileEntry("a", "a", 5), FileEntry("b", "b", 7))).total_bytes == 12


names = st.text(min_size=1, max_size=30)  # any Unicode except lone surrogates, which no blob name holds
entries = st.builds(
    FileEntry,
    name=names,
    path=st.one_of(names, st.just("")),
    size=st.integers(0, 2**63 - 1),
    etag=st.text(max_size=20),
    content_md5=st.text(max_size=24),
    last_modified=st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False),
)


@st.composite
def listings(draw: st.DrawFn) -> Listing:
    files = draw(st.lists(entries, max_size=20))
    # Most real paths equal their names (empty prefix): exercise the shortcut often.
    files = [f._replace(path=f.name) if draw(st.booleans()) else f for f in files]
    return Listing(
        files=tuple(files),
        markers_skipped=draw(st.integers(0, 10**6)),
        filtered_out=draw(st.integers(0, 10**6)),
        dangling=tuple(draw(st.lists(names, max_size=3))),
        aliases=tuple(draw(st.lists(names, max_size=3))),
    )


@given(listings())
@settings(max_examples=200)
def test_round_trip(listing: Listing) -> None:
    blob = encode_listing(listing)
    assert isinstance(blob, bytes)
    decoded = decode_listing(blob)
    assert decoded == listing
    assert [type(f.size) for f in decoded.files] == [int] * len(decoded.files)
    # Deterministic: every rank that encodes the same listing sends the same bytes.
    assert encode_listing(listing) == blob
