"""--delete's choice (dest/mirror.py's pure rules, property-tested), its walk of a real DEST and
its removal: links never followed, the tool's own files and other DESTs left alone, a file
changed since the walk kept; and the dry run's line per file (run/dryrun.py)."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.naming import JOURNAL_DIR, LOCK_NAME, MANIFEST_NAME, matches_filters
from azcp_cluster.dest import mirror
from azcp_cluster.dest.destroot import DestRoot
from azcp_cluster.run import dryrun

SEGMENTS = st.sampled_from(["a", "b", "c.bin", "d.txt", MANIFEST_NAME, LOCK_NAME, JOURNAL_DIR, ".x.azcp-part"])
PATHS = st.lists(SEGMENTS, min_size=1, max_size=3).map("/".join)
KINDS = st.sampled_from([mirror.FILE, mirror.LINK, mirror.DIR, mirror.OTHER])
ENTRIES = st.lists(st.builds(mirror.Entry, PATHS, KINDS, st.integers(0, 9)), max_size=30, unique_by=lambda e: e.rel)
GLOBS = st.lists(st.sampled_from(["*.bin", "a/*", "*", "b*", "*.txt"]), max_size=2)
# Paths SOURCE has without listing files below them (dangling links, aliases): of the walk's
# common names, so that most examples shelter something.
SHELTERS = st.lists(st.lists(st.sampled_from(["a", "b", "c.bin"]), min_size=1, max_size=2).map("/".join), max_size=3)


def _at_or_below(rel: str, shelter: list[str]) -> bool:
    return any(rel == s or rel.startswith(s + "/") for s in shelter)


@given(ENTRIES, st.lists(PATHS, max_size=10), GLOBS, GLOBS, SHELTERS)
def test_only_unlisted_unsheltered_regular_files_the_filters_select_are_chosen(
    found: list[mirror.Entry], listed: list[str], include: list[str], exclude: list[str], shelter: list[str]
) -> None:
    chosen = mirror.choose(listed, found, include, exclude, shelter)
    assert [e.rel for e in chosen] == sorted(e.rel for e in chosen)
    for e in chosen:
        assert e.kind == mirror.FILE  # never a link, a directory, a FIFO or a hard-linked file
        assert e.rel not in listed
        assert matches_filters(e.rel, include, exclude)  # an excluded file is not part of the mirror
        # Nothing at or below a path SOURCE has without listing files there (a dangling link, an alias).
        assert not _at_or_below(e.rel, shelter)
        parts = e.rel.split("/")
        assert JOURNAL_DIR not in parts  # a block journal, at any depth (a nested DEST's)
        assert not any(p in (MANIFEST_NAME, LOCK_NAME) or p.endswith(".azcp-part") for p in parts)
    # And nothing else is left out: every other unlisted, unsheltered regular file of the filters is chosen.
    missed = [
        e
        for e in found
        if e not in chosen
        and e.kind == mirror.FILE
        and e.rel not in listed
        and not _at_or_below(e.rel, shelter)
        and matches_filters(e.rel, include, exclude)
    ]
    assert all(mirror.tool_owned(e.rel) for e in missed)


# Names of plain data files and directories ("c" a string prefix of "c.bin", not its directory).
PLAIN = st.lists(st.sampled_from(["a", "b", "c", "c.bin"]), min_size=1, max_size=3).map("/".join)


@given(st.lists(PLAIN, max_size=20, unique=True), st.lists(PLAIN, max_size=5), st.data())
def test_a_sheltered_path_keeps_what_is_at_or_below_it_and_nothing_else(
    rels: list[str], listed: list[str], data: st.DataObject
) -> None:
    found = [mirror.Entry(rel, mirror.FILE) for rel in rels]
    # Sheltered: mostly a found file's own path or one of its directories, some other path.
    paths = sorted({"/".join(rel.split("/")[:depth]) for rel in rels for depth in range(1, rel.count("/") + 2)})
    shelter = data.draw(st.lists(st.sampled_from(paths) | PLAIN if paths else PLAIN, max_size=3))
    chosen = [e.rel for e in mirror.choose(listed, found, shelter=shelter)]
    assert chosen == sorted(rel for rel in rels if rel not in listed and not _at_or_below(rel, shelter))


def test_nothing_at_or_below_a_dangling_link_or_an_alias_of_source_is_chosen() -> None:
    found = [
        mirror.Entry(rel, mirror.FILE)
        for rel in ("model/weights.bin", "model/sub/x", "model", "model2/w.bin", "modelx", "a_alias/w.bin", "stale")
    ]
    # SOURCE: a link 'model' whose target is gone, and 'a_alias' listed where 'model' is an alias of it.
    chosen = mirror.choose(["a_alias/w.bin"], found, shelter=["model"])
    assert [e.rel for e in chosen] == ["model2/w.bin", "modelx", "stale"]  # whole segments only
    assert [e.rel for e in mirror.choose([], found, shelter=["model/sub", "stale"])] == [
        "a_alias/w.bin",
        "model",
        "model/weights.bin",
        "model2/w.bin",
        "modelx",
    ]
    assert not mirror.sheltered("model", set()) and mirror.sheltered("a/b/c", {"a/b"})


def test_the_tools_own_names_are_its_own_at_any_depth() -> None:
    assert mirror.tool_owned(f"{JOURNAL_DIR}/rank-0")
    assert mirror.tool_owned(f"inner/{JOURNAL_DIR}/rank-0")  # a nested DEST's journal
    assert mirror.tool_owned(f"a/b/{MANIFEST_NAME}") and mirror.tool_owned("a/.f.azcp-part")
    assert not mirror.tool_owned("inner/rank-0")


@given(st.lists(PATHS, max_size=10))
def test_emptied_directories_are_the_removed_files_ancestors_deepest_first(removed: list[str]) -> None:
    dirs = mirror.emptied_dirs(removed)
    assert "" not in dirs  # never DEST itself
    expected = {"/".join(p.split("/")[:d]) for p in removed for d in range(1, p.count("/") + 1)}
    assert set(dirs) == expected
    depths = [d.count("/") for d in dirs]
    assert depths == sorted(depths, reverse=True)


def test_a_directory_holding_the_tools_manifest_or_lock_is_another_dest() -> None:
    assert mirror.descend("x", ["a", "b"])
    assert not mirror.descend("x", ["a", MANIFEST_NAME])
    assert not mirror.descend("x", [LOCK_NAME])
    assert not mirror.descend(JOURNAL_DIR, [])
    # A nested DEST whose run was stopped: its journal, and neither manifest nor lock.
    assert not mirror.descend("x", [JOURNAL_DIR, ".w.bin.azcp-part"])


def _write(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _hostile_dest(tmp_path: Path) -> tuple[Path, Path]:
    """A DEST with everything a hostile tester puts there, and a tree outside it (returned second)."""
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    _write(outside / "secret")
    _write(outside / "dir" / "deep")
    _write(dest / "keep.bin")  # listed
    _write(dest / "stale.bin")
    _write(dest / "old" / "sub" / "stale2")  # its directories emptied: removed
    (dest / "empty-before").mkdir()  # empty already: not the deletion's doing, stays
    os.symlink(outside / "dir", dest / "linkdir")  # never descended
    os.symlink(outside / "secret", dest / "linkfile")  # never removed, never followed
    os.link(_write(outside / "hard"), dest / "hardlink")  # a name another file shares: stays
    os.mkfifo(dest / "fifo")
    _write(dest / MANIFEST_NAME)
    _write(dest / LOCK_NAME)
    _write(dest / JOURNAL_DIR / "0.journal")
    _write(dest / ".gone.bin.azcp-part")  # a stopped run's temporary file: the tool's own
    _write(dest / "nested" / MANIFEST_NAME)  # another DEST below this one
    _write(dest / "nested" / "theirs.bin")
    _write(dest / "stopped" / JOURNAL_DIR / "rank-0")  # another DEST whose run was stopped
    _write(dest / "stopped" / ".w.bin.azcp-part")
    _write(dest / "stopped" / "theirs.bin")
    _write(dest / "excluded.txt")
    return dest, outside


def _everything(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def test_the_walk_and_removal_touch_only_unlisted_regular_files_below_dest(tmp_path: Path) -> None:
    dest, outside = _hostile_dest(tmp_path)
    before_outside = _everything(outside)
    tree = DestRoot(str(dest))
    try:
        found = mirror.walk(tree)
        walked = {e.rel for e in found}
        assert not any(rel.startswith(("linkdir/", "nested/", "stopped/", f"{JOURNAL_DIR}/")) for rel in walked)
        chosen = mirror.choose(["keep.bin"], found, (), ("*.txt",))
        assert [e.rel for e in chosen] == ["old/sub/stale2", "stale.bin"]
        done = mirror.remove(tree, chosen)
    finally:
        tree.close()
    assert done == mirror.Removed(("old/sub/stale2", "stale.bin"), 2, ())
    left = _everything(dest)
    assert "old" not in left and "stale.bin" not in left
    for kept in ("keep.bin", "empty-before", "linkdir", "linkfile", "hardlink", "fifo", MANIFEST_NAME, LOCK_NAME):
        assert kept in left
    assert {".gone.bin.azcp-part", "nested/theirs.bin", "excluded.txt", f"{JOURNAL_DIR}/0.journal"} <= left
    assert {f"stopped/{JOURNAL_DIR}/rank-0", "stopped/.w.bin.azcp-part", "stopped/theirs.bin"} <= left
    assert _everything(outside) == before_outside and (outside / "secret").read_bytes() == b"x"


def test_a_file_changed_or_replaced_after_the_walk_is_kept(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    for name in ("rewritten", "replaced", "gone", "moved/f", "same"):
        _write(dest / name, b"old")
    outside = _write(tmp_path / "outside" / "f", b"outside")
    tree = DestRoot(str(dest))
    try:
        chosen = mirror.choose([], mirror.walk(tree))
        (dest / "rewritten").write_bytes(b"new content")  # someone writes into DEST during the run
        (dest / "replaced").unlink()
        _write(dest / "replaced", b"old")  # another file (inode) at the name
        (dest / "gone").unlink()
        (dest / "moved").rename(tmp_path / "moved-away")
        os.symlink(outside.parent, dest / "moved")  # the directory swapped for a link
        done = mirror.remove(tree, chosen)
    finally:
        tree.close()
    assert done.paths == ("same",)
    assert set(done.kept) == {"rewritten", "replaced", "gone", "moved/f"}
    assert (dest / "rewritten").read_bytes() == b"new content" and (dest / "replaced").exists()
    assert outside.read_bytes() == b"outside" and (tmp_path / "moved-away" / "f").exists()


def test_a_dest_that_does_not_exist_walks_to_nothing(tmp_path: Path) -> None:
    tree = DestRoot(str(tmp_path / "missing"))
    assert mirror.walk(tree) == []


def test_the_dry_runs_lines_say_each_files_action_size_and_nodes() -> None:
    files = [FileEntry(name=f"p/{n}", path=n, size=s) for n, s in [("a", 1 << 30), ("b", 10), ("c", 2048), ("d", 5)]]
    # a: no node has it; b: node 0 has it; c: a stopped run kept blocks; d: everywhere.
    lines = dryrun.file_lines(files, [0, 1, 2], [(), (0,), (), (0, 1, 2)], {2: ()}, [[("old", 7)], [], [("old", 7)]])
    assert lines == [
        "new        1.00 GiB  3/3  a",
        "peer           10 B  2/3  b",
        "resume     2.00 KiB  3/3  c",
        "skip            5 B  3/3  d",
        "delete          7 B  2/3  old",
        "[dry-run] 4 files: 1 new (1.00 GiB), 1 peer (10 B), 1 resume (2.00 KiB), 1 skip (5 B); 1 delete (7 B) "
        "on 3 copies",
    ]
    assert dryrun.file_lines(files[3:], [], [(0,)], {}, [[]])[-1] == "[dry-run] 1 file: 1 skip (5 B)"


def test_a_mount_point_below_dest_is_not_descended(tmp_path: Path) -> None:
    from tests.conftest import bind_mount

    outside = _write(tmp_path / "outside" / "victim.bin").parent
    dest = tmp_path / "dest"
    _write(dest / "stale.bin")
    with bind_mount(outside, dest / "mounted"):  # the same filesystem: only the mount table tells
        tree = DestRoot(str(dest))
        try:
            found = mirror.walk(tree)
            chosen = mirror.choose([], found)
            assert [e.rel for e in chosen] == ["stale.bin"]
            assert {e.rel: e.kind for e in found}["mounted"] == mirror.MOUNT
            mirror.remove(tree, chosen)
        finally:
            tree.close()
    assert (outside / "victim.bin").exists() and not (dest / "stale.bin").exists()
