"""The manifest in DEST (manifest.py): what a save keeps, what it looks at, when it writes."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.naming import MANIFEST_NAME
from azcp_cluster.dest import manifest
from azcp_cluster.dest.desttree import DestTree


def _file(path: str, size: int, etag: str = "e") -> FileEntry:
    return FileEntry(name=path, path=path, size=size, etag=etag)


@pytest.fixture
def dest(tmp_path: Path) -> DestTree:
    for rel, size in {"a": 3, "d/b": 5, "d/c": 7}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x" * size)
    tree = DestTree(str(tmp_path))
    manifest.save(tree, [_file("a", 3), _file("d/b", 5), _file("d/c", 7)], {})
    return tree


def _looked_at(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names a save looks at in DEST (DestTree.present_all)."""
    seen: list[str] = []
    original = DestTree.present_all

    def present_all(self: DestTree, files: Iterable[tuple[str, int]]) -> list[bool]:
        wanted = list(files)
        seen.extend(rel for rel, _ in wanted)
        return original(self, wanted)

    monkeypatch.setattr(DestTree, "present_all", present_all)
    return seen


def test_a_save_looks_only_at_the_entries_the_compare_did_not_find(
    dest: DestTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _looked_at(monkeypatch)
    before = (Path(dest.real) / MANIFEST_NAME).stat()
    manifest.save(dest, [], manifest.load(dest), {"a": 3, "d/b": 5, "d/c": 7})
    assert seen == []  # a no-op rerun: every entry's file was just found, nothing looked at again
    after = (Path(dest.real) / MANIFEST_NAME).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # nor written
    # An entry the compare found at another size, or did not look at, is looked at.
    manifest.save(dest, [], manifest.load(dest), {"a": 3, "d/b": 4})
    assert sorted(seen) == ["d/b", "d/c"]


def test_an_entry_whose_file_is_gone_is_dropped(dest: DestTree) -> None:
    (Path(dest.real) / "d" / "c").unlink()
    manifest.save(dest, [], manifest.load(dest), {"a": 3, "d/b": 5})
    assert sorted(manifest.load(dest)) == ["a", "d/b"]
    # The compare's word is taken for what it found: no look behind it.
    (Path(dest.real) / "a").unlink()
    manifest.save(dest, [], manifest.load(dest), {"a": 3, "d/b": 5})
    assert sorted(manifest.load(dest)) == ["a", "d/b"]
    manifest.save(dest, [], manifest.load(dest))  # nothing found by a compare: every entry looked at
    assert sorted(manifest.load(dest)) == ["d/b"]


def test_a_new_version_is_recorded_and_a_same_one_writes_nothing(dest: DestTree) -> None:
    found = {"a": 3, "d/b": 5, "d/c": 7}
    before = (Path(dest.real) / MANIFEST_NAME).stat()
    manifest.save(dest, [_file("a", 3)], manifest.load(dest), found)  # the same version again
    after = (Path(dest.real) / MANIFEST_NAME).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    manifest.save(dest, [_file("a", 3, etag="new")], manifest.load(dest), found)
    assert manifest.load(dest)["a"].etag == "new"
