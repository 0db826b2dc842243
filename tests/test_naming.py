"""Unit and property tests for the prefix, marker, filter, safety and collision rules (naming.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.errors import ListError, exit_code_for
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.naming import (
    LOCK_NAME,
    MANIFEST_NAME,
    TEMP_SUFFIX,
    RawEntry,
    check_collisions,
    check_relative_path,
    directory_prefix,
    is_marker,
    matches_filters,
    select,
)


def raw(*names: str, size: int = 1) -> list[RawEntry]:
    return [RawEntry(name=n, size=size) for n in names]


def paths(listing_files: tuple[FileEntry, ...]) -> list[str]:
    return [f.path for f in listing_files]


# ---------------------------------------------------------------------------------------
# directory_prefix / is_marker


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [("", ""), ("ckpt", "ckpt/"), ("ckpt/", "ckpt/"), ("a/b", "a/b/"), ("a/b/", "a/b/")],
)
def test_directory_prefix(prefix: str, expected: str) -> None:
    assert directory_prefix(prefix) == expected


def test_is_marker() -> None:
    assert is_marker(RawEntry("dir/", 0))
    assert is_marker(RawEntry("dir", 0, is_folder=True))
    assert not is_marker(RawEntry("dir", 0))
    assert not is_marker(RawEntry("dir/file", 5))


# ---------------------------------------------------------------------------------------
# Prefix rules


def test_prefix_names_a_virtual_directory() -> None:
    children = raw("ckpt/a.bin", "ckpt/sub/b.bin", "ckpt-other/x", "ckptx", "other/ckpt/y")
    listing = select("ckpt", None, children)
    # The listing must never widen the prefix: siblings that merely start with "ckpt" are not copied.
    assert paths(listing.files) == ["a.bin", "sub/b.bin"]
    assert [f.name for f in listing.files] == ["ckpt/a.bin", "ckpt/sub/b.bin"]
    assert select("ckpt/", None, children) == listing


def test_empty_prefix_takes_the_whole_container() -> None:
    listing = select("", None, raw("b", "a/c", "a/d"))
    assert paths(listing.files) == ["a/c", "a/d", "b"]
    assert all(f.path == f.name for f in listing.files)


def test_exact_blob_is_copied_alone_to_its_basename() -> None:
    exact = RawEntry("models/ckpt", 7, etag="e1", content_md5="m1", last_modified=3.5)
    listing = select("models/ckpt", exact, raw("models/ckpt/a", "models/ckpt/b"))
    assert listing.files == (
        FileEntry(name="models/ckpt", path="ckpt", size=7, etag="e1", content_md5="m1", last_modified=3.5),
    )
    assert listing.markers_skipped == 0
    assert listing.filtered_out == 0


def test_exact_blob_ignored_when_prefix_ends_with_slash_or_is_a_marker() -> None:
    children = raw("ckpt/a")
    assert paths(select("ckpt/", RawEntry("ckpt/", 0), children).files) == ["a"]
    assert paths(select("ckpt", RawEntry("ckpt", 0, is_folder=True), children).files) == ["a"]


def test_exact_blob_filters_match_its_basename() -> None:
    exact = RawEntry("dir/model.bin", 3)
    assert paths(select("dir/model.bin", exact, [], include=["*.bin"]).files) == ["model.bin"]
    excluded = select("dir/model.bin", exact, [], exclude=["model.*"])
    assert excluded.files == ()
    assert excluded.filtered_out == 1


def test_exact_blob_with_negative_size_is_refused() -> None:
    with pytest.raises(ListError):
        select("x", RawEntry("x", -1), [])


# ---------------------------------------------------------------------------------------
# Markers


def test_markers_are_skipped_and_counted() -> None:
    children = [
        RawEntry("ckpt/", 0),
        RawEntry("ckpt/sub/", 0),
        RawEntry("ckpt/folder", 0, is_folder=True),
        RawEntry("ckpt/folder/file", 4),
    ]
    listing = select("ckpt", None, children)
    assert paths(listing.files) == ["folder/file"]
    assert listing.markers_skipped == 3
    assert listing.total_bytes == 4


# ---------------------------------------------------------------------------------------
# Filters


def test_star_crosses_slashes() -> None:
    assert matches_filters("a/b/c.json", ["*.json"], [])
    assert matches_filters("a/b/c.json", ["a/*"], [])
    assert not matches_filters("a/b/c.json", ["b/*"], [])


def test_include_and_exclude() -> None:
    assert matches_filters("x", [], [])
    assert matches_filters("x.bin", ["*.bin", "*.json"], [])
    assert not matches_filters("x.txt", ["*.bin", "*.json"], [])
    assert not matches_filters("x.bin", ["*.bin"], ["x*"])
    assert not matches_filters("x.bin", [], ["*.bin"])
    # Case-sensitive on every platform.
    assert not matches_filters("X.BIN", ["*.bin"], [])


def test_filters_match_the_path_below_the_prefix() -> None:
    children = raw("ckpt/model.safetensors", "ckpt/sub/model.safetensors", "ckpt/config.json", "ckpt/README.md")
    listing = select("ckpt", None, children, include=["*.safetensors", "*.json"], exclude=["sub/*"])
    assert paths(listing.files) == ["config.json", "model.safetensors"]
    assert listing.filtered_out == 2
    # Patterns that spell the prefix do not match: filters see the relative path.
    assert select("ckpt", None, children, include=["ckpt/*"]).files == ()


# ---------------------------------------------------------------------------------------
# Safety


@pytest.mark.parametrize(
    "path",
    ["", "/etc/passwd", "..", "../x", "a/../../x", "a/..", ".", "./a", "a/./b", "a//b", "a\x00b", "a/b/"],
)
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(ListError) as info:
        check_relative_path(path, "NAME")
    assert info.value.path == "NAME"
    assert exit_code_for(info.value) == 3


@pytest.mark.parametrize("path", ["a", "a/b/c", "..a", "a..", "...", ".hidden/x", "a b/ü/模型.bin", "a\\..\\b"])
def test_safe_paths_are_kept(path: str) -> None:
    assert check_relative_path(path, path) == path


@pytest.mark.parametrize(
    ("prefix", "name"),
    [("ckpt", "ckpt/../escape"), ("ckpt", "ckpt//etc/passwd"), ("", "/etc/passwd"), ("", "a/./b"), ("", "x\x00")],
)
def test_select_refuses_unsafe_names(prefix: str, name: str) -> None:
    with pytest.raises(ListError) as info:
        select(prefix, None, raw("ckpt/fine" if prefix else "fine", name))
    assert info.value.path == name


def test_select_refuses_negative_sizes() -> None:
    with pytest.raises(ListError):
        select("", None, [RawEntry("a", -1)])


safe_segment = st.text(st.sampled_from("abcxyz09_-.é模"), min_size=1, max_size=5).filter(lambda s: s not in (".", ".."))
bad_segment = st.sampled_from(["", ".", ".."])


@given(st.lists(safe_segment, min_size=1, max_size=5))
@settings(max_examples=150)
def test_safe_relative_paths_pass(segments: list[str]) -> None:
    path = "/".join(segments)
    assert check_relative_path(path, path) == path


@given(st.lists(safe_segment, max_size=4), bad_segment, st.lists(safe_segment, max_size=4))
@settings(max_examples=150)
def test_any_bad_segment_is_refused(before: list[str], bad: str, after: list[str]) -> None:
    path = "/".join([*before, bad, *after])
    with pytest.raises(ListError):
        check_relative_path(path, path)


# ---------------------------------------------------------------------------------------
# Collisions


def entry(path: str) -> FileEntry:
    return FileEntry(name=path, path=path, size=1)


def test_file_and_directory_of_the_same_name_collide() -> None:
    with pytest.raises(ListError) as info:
        check_collisions([entry("a"), entry("a/b")])
    assert info.value.path == "a"
    with pytest.raises(ListError):
        check_collisions([entry("x/y/z/w"), entry("x/y")])
    check_collisions([entry("a"), entry("ab/c"), entry("a.d/e"), entry("b/a")])
    check_collisions([])


def test_select_refuses_collisions_unless_filtered_away() -> None:
    children = raw("ckpt/a", "ckpt/a/b")
    with pytest.raises(ListError):
        select("ckpt", None, children)
    listing = select("ckpt", None, children, exclude=["a/*"])
    assert paths(listing.files) == ["a"]
    # A directory marker named like a file's directory is no collision.
    assert paths(select("ckpt", None, [RawEntry("ckpt/a/", 0), *raw("ckpt/a/b")]).files) == ["a/b"]


# ---------------------------------------------------------------------------------------
# Whole-listing properties

names_below = st.lists(st.lists(safe_segment, min_size=1, max_size=3).map("/".join), max_size=25, unique=True)


@given(
    prefix=st.sampled_from(["", "ckpt", "ckpt/", "a/ckpt"]),
    rels=names_below,
    markers=st.lists(st.lists(safe_segment, min_size=1, max_size=2).map(lambda s: "/".join(s) + "/"), max_size=5),
    noise=st.lists(st.sampled_from(["ckpt-other/x", "ckptx", "zzz/ckpt/y", "b"]), max_size=3),
    include=st.lists(st.sampled_from(["*", "*.bin", "a*", "*/*", "*é*"]), max_size=2),
    exclude=st.lists(st.sampled_from(["*.json", "x*", "*9"]), max_size=2),
)
@settings(max_examples=200, deadline=None)
def test_select_properties(
    prefix: str,
    rels: list[str],
    markers: list[str],
    noise: list[str],
    include: list[str],
    exclude: list[str],
) -> None:
    dir_prefix = directory_prefix(prefix)
    children = [RawEntry(dir_prefix + r, len(r)) for r in rels]
    children += [RawEntry(dir_prefix + m, 0) for m in markers]
    children += [RawEntry(n, 1) for n in noise if not n.startswith(dir_prefix)]
    kept = sorted((r for r in rels if matches_filters(r, include, exclude)), key=lambda r: dir_prefix + r)
    kept_set = set(kept)
    collides = any("/".join(r.split("/")[:d]) in kept_set for r in kept for d in range(1, r.count("/") + 1))
    if collides:
        with pytest.raises(ListError):
            select(prefix, None, children, include, exclude)
        return
    listing = select(prefix, None, children, include, exclude)
    assert paths(listing.files) == kept
    assert [f.name for f in listing.files] == sorted(f.name for f in listing.files)
    assert all(f.name == dir_prefix + f.path and f.size == len(f.path) for f in listing.files)
    assert listing.markers_skipped == len(markers)
    assert listing.filtered_out == len(rels) - len(kept)
    # Input order does not matter.
    assert select(prefix, None, list(reversed(children)), include, exclude) == listing


@pytest.mark.parametrize(
    "name",
    [
        "p/.x.azcp-part",
        "p/d/y.azcp-part",
        "p/.azcp-manifest.json",
        "p/.azcp-lock",
        # At any level, not only at the end:
        "p/x.azcp-part/y",
        "p/.x.azcp-part/y",  # would be x's temporary name as a directory
        "p/.azcp-part/y",
        "p/d/.azcp-manifest.json",
        "p/d/.azcp-manifest.json/x",
        "p/d/.azcp-lock",
        "p/.azcp-lock/x",
    ],
)
def test_names_reserved_by_the_tool_are_refused(name: str) -> None:
    with pytest.raises(ListError, match="reserved") as info:
        select("p", None, [RawEntry(name, 1)])
    assert info.value.path == name and exit_code_for(info.value) == 3


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("a/b.azcp-part/c", "reserved for the tool's temporary files"),
        ("a/.azcp-manifest.json", "reserved for the tool's manifest"),
        ("a/.azcp-manifest.json/b", "reserved for the tool's manifest"),
        ("lock/.azcp-lock", "reserved for the tool's lock file"),
    ],
)
def test_reserved_names_say_what_they_are_reserved_for(path: str, words: str) -> None:
    with pytest.raises(ListError, match=words):
        check_relative_path(path, path)


@pytest.mark.parametrize(
    "path", ["x.azcp-partial", "azcp-part", "a/.azcp-manifest.json.bak", "a/azcp-lock", "a/.azcp-lock2", "x.azcp-par"]
)
def test_names_that_only_resemble_the_tools_are_kept(path: str) -> None:
    assert check_relative_path(path, path) == path


reserved_segment = st.one_of(
    st.sampled_from([MANIFEST_NAME, LOCK_NAME, TEMP_SUFFIX]),
    safe_segment.map(lambda s: s + TEMP_SUFFIX),
    safe_segment.map(lambda s: "." + s + TEMP_SUFFIX),
)


@given(st.lists(safe_segment, max_size=4), reserved_segment, st.lists(safe_segment, max_size=4))
@settings(max_examples=200)
def test_a_reserved_segment_at_any_level_is_refused(before: list[str], reserved: str, after: list[str]) -> None:
    path = "/".join([*before, reserved, *after])
    with pytest.raises(ListError, match="reserved"):
        check_relative_path(path, path)


@given(st.lists(safe_segment, min_size=1, max_size=3))
@settings(max_examples=100)
def test_a_file_and_its_temporary_name_as_a_directory_cannot_both_be_listed(segments: list[str]) -> None:
    """``x`` and ``.x.azcp-part/y``: the second is refused, so it cannot collide with x's temporary file."""
    *parent, base = segments
    first = "/".join([*parent, base])
    second = "/".join([*parent, f".{base}{TEMP_SUFFIX}", "y"])
    assert check_relative_path(first, first) == first
    with pytest.raises(ListError, match="reserved"):
        select("", None, [RawEntry(first, 1), RawEntry(second, 1)])


def test_names_too_long_for_the_filesystem_are_refused() -> None:
    from azcp_cluster.core.naming import MAX_PATH_BYTES, MAX_SEGMENT_BYTES, TEMP_SUFFIX, check_relative_path

    ok = "d/" + "n" * MAX_SEGMENT_BYTES
    assert check_relative_path(ok, ok) == ok
    assert len(("." + "n" * MAX_SEGMENT_BYTES + TEMP_SUFFIX).encode()) == 255  # the temporary name fits
    for bad in ("d/" + "n" * (MAX_SEGMENT_BYTES + 1), "é" * (MAX_SEGMENT_BYTES // 2 + 1), "/".join(["x" * 200] * 16)):
        assert len(bad.encode()) > MAX_SEGMENT_BYTES
        with pytest.raises(ListError, match="too long for the filesystem"):
            check_relative_path(bad, bad)
    assert len("/".join(["x" * 200] * 16)) > MAX_PATH_BYTES


# ---------------------------------------------------------------------------------------
# The rules checked once per directory give what they give one name at a time


def _refusal(path: str, checked: set[str] | None) -> str:
    try:
        return check_relative_path(path, path, checked)
    except ListError as exc:
        return f"refused: {exc}"


any_segment = st.one_of(
    safe_segment, bad_segment, st.sampled_from([MANIFEST_NAME, LOCK_NAME, "x" + TEMP_SUFFIX, "a" * 260])
)


@given(st.lists(st.lists(any_segment, min_size=1, max_size=5).map("/".join), min_size=1, max_size=30))
@settings(max_examples=300, deadline=None)
def test_the_directories_checked_once_refuse_and_keep_what_each_name_alone_would(names: list[str]) -> None:
    checked: set[str] = set()
    for path in names:
        assert _refusal(path, checked) == _refusal(path, None)
    # Only directories found safe are remembered.
    assert all(_refusal(d, None) == d for d in checked if d)


def _collision(files: list[FileEntry]) -> str:
    try:
        check_collisions(files)
        return ""
    except ListError as exc:
        return str(exc)


def _collision_name_by_name(files: list[FileEntry]) -> str:
    paths = {f.path for f in files}
    for f in files:
        parts = f.path.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in paths:
                return f"'{'/'.join(parts[:depth])}' is both a file and the directory of '{f.path}'"
    return ""


@given(st.lists(st.lists(st.sampled_from("abc"), min_size=1, max_size=4).map("/".join), max_size=30, unique=True))
@settings(max_examples=300, deadline=None)
def test_collisions_found_once_per_directory_are_those_found_name_by_name(names: list[str]) -> None:
    files = [entry(name) for name in names]  # in any order
    found, expected = _collision(files), _collision_name_by_name(files)
    assert found.startswith(expected) and bool(found) == bool(expected)


def test_a_name_listed_twice_is_kept_once() -> None:
    """A directory listed from two places (a service that repeats a directory prefix across
    delimiter pages) gives its blobs twice: each is kept once, and the order holds."""
    listing = select("", None, [*raw("a/x", "b/y"), *raw("a/x", "c")])
    assert paths(listing.files) == ["a/x", "b/y", "c"]


def test_two_versions_of_one_name_in_a_listing_are_an_error() -> None:
    entries = [RawEntry("a/x", 5, etag="0x1"), RawEntry("a/x", 5, etag="0x2")]
    with pytest.raises(ListError, match="listed twice") as caught:
        select("", None, entries)
    assert caught.value.path == "a/x"
