"""Listing a local SOURCE (azcp_cluster/dest/localsource.py), on real directories."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import ListError, UsageError
from azcp_cluster.core.naming import LOCK_NAME, MANIFEST_NAME, TEMP_SUFFIX
from azcp_cluster.dest import localsource
from azcp_cluster.dest.localsource import (
    CTIME_KEEPING,
    SETTLED_NS,
    Trust,
    as_listed,
    check_overlap,
    identity,
    list_local,
    local_etag,
    source_file,
    trusted,
)


def _cfg(**kw: object) -> Config:
    return Config(source="x", dest="y", **kw)  # type: ignore[arg-type]


def test_tree_is_listed_with_relative_paths_sizes_and_etags(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "a.bin").write_bytes(b"12345")
    (tmp_path / "sub" / "b c.txt").write_bytes(b"")
    (tmp_path / "sub" / "deep" / "é.dat").write_bytes(b"xy")
    (tmp_path / "emptydir").mkdir()
    listing = list_local(str(tmp_path), _cfg())
    assert [(f.path, f.size) for f in listing.files] == [("a.bin", 5), ("sub/b c.txt", 0), ("sub/deep/é.dat", 2)]
    entry = listing.files[0]
    # Just written: its change time is not settled yet, so its ETag is weak.
    assert entry.name == entry.path and entry.etag == local_etag(os.stat(tmp_path / "a.bin"), trusted=False)
    assert entry.content_md5 == ""


def test_etag_changes_with_mtime(tmp_path: Path) -> None:
    f = tmp_path / "a"
    f.write_bytes(b"same")
    before = list_local(str(tmp_path), _cfg()).files[0].etag
    os.utime(f, ns=(1, 10**18))
    assert list_local(str(tmp_path), _cfg()).files[0].etag != before


def _settled_listing(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ETags of a listing made as if SETTLED_NS had passed since now."""
    later = time.time_ns() + SETTLED_NS + 10**9
    monkeypatch.setattr(localsource.time, "time_ns", lambda: later)
    return [f.etag for f in list_local(str(root), _cfg()).files]


def test_a_settled_file_on_a_filesystem_that_keeps_change_times_gets_a_strong_etag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if localsource.filesystem_type(str(tmp_path)) not in CTIME_KEEPING:
        pytest.skip("the test directory's filesystem does not keep change times")
    (tmp_path / "a").write_bytes(b"data")
    (etag,) = _settled_listing(tmp_path, monkeypatch)
    st = os.stat(tmp_path / "a")
    assert etag == identity(st) == f'"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ctime_ns:x}-{st.st_ino:x}"'
    assert not etag.startswith("W/")


@pytest.mark.parametrize("how", ["in-place", "replaced"])
def test_a_rewrite_that_keeps_size_and_mtime_changes_the_etag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # cp -p (the same inode, rewritten) or rsync -t (a new file renamed over it): the size and
    # mtime are those of the old file, the change time (and for a new file the inode) is not.
    f = tmp_path / "a"
    f.write_bytes(b"old!")
    os.utime(f, ns=(10**18, 10**18))
    before = os.stat(f)
    etag = list_local(str(tmp_path), _cfg()).files[0].etag
    time.sleep(0.01)
    if how == "in-place":
        f.write_bytes(b"new!")
    else:
        (tmp_path / "tmp").write_bytes(b"new!")
        os.replace(tmp_path / "tmp", f)
    os.utime(f, ns=(10**18, 10**18))
    after = os.stat(f)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    again = list_local(str(tmp_path), _cfg()).files[0].etag
    assert again != etag and not as_listed(after, etag) and as_listed(after, again)


def test_trust_needs_a_filesystem_that_keeps_change_times_and_a_settled_change_time() -> None:
    now = 10**19
    assert trusted(0xEF53, now - SETTLED_NS, now)
    assert not trusted(0xEF53, now - SETTLED_NS + 1, now)  # changed within the granularity
    assert not trusted(0xEF53, now + 10**9, now)  # a change time ahead of the reader's clock
    assert not trusted(0x65735546, 0, now)  # FUSE (blobfuse): the daemon says what it likes
    assert not trusted(0x4D44, 0, now)  # FAT keeps no change time
    assert not trusted(None, 0, now)  # unknown


def test_a_file_on_a_filesystem_without_trusted_change_times_gets_a_weak_etag(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"data")
    st = os.stat(tmp_path / "a")
    asked: list[str] = []

    def fuse(path: str) -> int:
        asked.append(path)
        return 0x65735546

    trust = Trust(now_ns=st.st_ctime_ns + 10 * SETTLED_NS, fs_type=fuse)
    assert trust.etag(str(tmp_path / "a"), st) == f"W/{identity(st)}"
    assert trust.etag(str(tmp_path / "a"), st) == f"W/{identity(st)}"
    assert asked == [str(tmp_path / "a")], "one statfs per device"
    ext4 = Trust(now_ns=st.st_ctime_ns + 10 * SETTLED_NS, fs_type=lambda _: 0xEF53)
    assert ext4.etag(str(tmp_path / "a"), st) == identity(st)
    assert as_listed(st, f"W/{identity(st)}") and as_listed(st, identity(st))


def test_single_file_is_listed_under_its_basename(tmp_path: Path) -> None:
    (tmp_path / "w.safetensors").write_bytes(b"abc")
    listing = list_local(str(tmp_path / "w.safetensors"), _cfg())
    assert [(f.name, f.path, f.size) for f in listing.files] == [("w.safetensors", "w.safetensors", 3)]
    assert source_file(str(tmp_path / "w.safetensors"), "w.safetensors", single=True) == str(tmp_path / "w.safetensors")
    assert source_file("/data", "a/b", single=False) == "/data/a/b"


def test_filters_apply_below_the_root(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    for name in ("shards/0.bin", "shards/1.bin", "readme.md"):
        (tmp_path / name).write_bytes(b"x")
    listing = list_local(str(tmp_path), _cfg(include=("shards/*",), exclude=("*1.bin",)))
    assert [f.path for f in listing.files] == ["shards/0.bin"] and listing.filtered_out == 2


def test_symlinks_are_followed_and_loops_walked_once(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "f").write_bytes(b"data")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link-to-file").symlink_to(real / "f")
    (root / "dir").symlink_to(real)
    (real / "loop").symlink_to(root)  # root/dir/loop -> root: must not recurse forever
    listing = list_local(str(root), _cfg())
    assert [f.path for f in listing.files] == ["dir/f", "link-to-file"]
    assert listing.aliases == ("dir/loop",)  # root again: SOURCE has its files there too (--delete keeps them)


def test_a_tree_reached_twice_is_named_by_its_shallowest_then_first_sorting_path(tmp_path: Path) -> None:
    # Which name a doubly reached directory gets must not depend on the walk's threads or the
    # filesystem's directory order: the shallowest path wins, then the first in name order.
    root = tmp_path / "root"
    (root / "m-real").mkdir(parents=True)
    (root / "m-real" / "f").write_bytes(b"x")
    (root / "z-link").symlink_to(root / "m-real")
    (root / "b-link").symlink_to(root / "m-real")
    (root / "a").mkdir()
    (root / "a" / "deep-link").symlink_to(root / "m-real")  # deeper: never the name used
    listing = list_local(str(root), _cfg())
    assert [f.path for f in listing.files] == ["b-link/f"]
    # Every other name SOURCE has the tree under: --delete removes nothing below them.
    assert listing.aliases == ("a/deep-link", "m-real", "z-link")


def test_dangling_links_are_named_in_the_listing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "f").write_bytes(b"x")
    (root / "model").symlink_to(tmp_path / "unmounted" / "model")  # a share away for a moment
    (root / "sub" / "gone.bin").symlink_to(tmp_path / "nowhere")
    listing = list_local(str(root), _cfg())
    assert [f.path for f in listing.files] == ["f"] and listing.filtered_out == 2
    assert listing.dangling == ("model", "sub/gone.bin") and listing.aliases == ()


def test_the_threaded_walk_lists_what_a_plain_walk_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import azcp_cluster.dest.localsource as localsource
    from azcp_cluster.dest import syscalls

    # Small batches and few threads: directories split over several tasks, tasks queued.
    monkeypatch.setattr(localsource, "STAT_BATCH", 7)
    monkeypatch.setattr(syscalls, "SLOW_CALL", 0.0)  # every call "slow": all on threads
    monkeypatch.setattr(syscalls, "CALIBRATE", 0)
    expected = {}
    for d in range(9):
        folder = tmp_path / f"d{d}" / ("sub" if d % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(d * 5):
            rel = (folder / f"f{i}").relative_to(tmp_path).as_posix()
            (tmp_path / rel).write_bytes(b"y" * i)
            expected[rel] = i
    (tmp_path / "top").write_bytes(b"zz")
    expected["top"] = 2
    listing = list_local(str(tmp_path), _cfg())
    assert [(f.path, f.size) for f in listing.files] == sorted(expected.items())


def test_a_stat_error_in_one_batch_names_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import azcp_cluster.dest.localsource as localsource

    monkeypatch.setattr(localsource, "STAT_BATCH", 2)
    for i in range(10):
        (tmp_path / f"f{i}").write_bytes(b"x")
    real_stat = os.DirEntry.stat

    def failing(self: os.DirEntry[str], *, follow_symlinks: bool = True) -> os.stat_result:
        if self.name == "f3":
            raise PermissionError(13, "Permission denied")
        return real_stat(self, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(localsource, "_stat_entry", failing)
    with pytest.raises(ListError, match="cannot stat a file of SOURCE: Permission denied") as err:
        list_local(str(tmp_path), _cfg())
    assert err.value.path == str(tmp_path / "f3")


def test_special_files_and_the_tools_own_files_are_left_out(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / MANIFEST_NAME).write_text("{}")
    (tmp_path / f".x{TEMP_SUFFIX}").write_bytes(b"half")
    (tmp_path / "data").write_bytes(b"ok")
    listing = list_local(str(tmp_path), _cfg())
    assert [f.path for f in listing.files] == ["data"] and listing.filtered_out == 3


def test_a_top_level_lock_file_is_left_out(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("held by an earlier run")
    (tmp_path / "data").write_bytes(b"ok")
    listing = list_local(str(tmp_path), _cfg())
    assert [f.path for f in listing.files] == ["data"] and listing.filtered_out == 1


@pytest.mark.parametrize("reserved", [f"sub/{LOCK_NAME}", f"sub/{MANIFEST_NAME}", f"d{TEMP_SUFFIX}/f"])
def test_the_tools_names_deeper_in_the_tree_are_refused(tmp_path: Path, reserved: str) -> None:
    path = tmp_path / reserved
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x")
    with pytest.raises(ListError, match="reserved"):
        list_local(str(tmp_path), _cfg())


def test_missing_and_unreadable_sources(tmp_path: Path) -> None:
    with pytest.raises(ListError, match="cannot read SOURCE"):
        list_local(str(tmp_path / "nope"), _cfg())
    if os.getuid() != 0:  # root reads anything; the unreadable directory case needs a user
        locked = tmp_path / "locked"
        locked.mkdir(mode=0)
        with pytest.raises(ListError, match="cannot list"):
            list_local(str(tmp_path), _cfg())


def test_device_source_is_refused() -> None:
    with pytest.raises(UsageError, match="neither a regular file nor a directory"):
        list_local("/dev/null", _cfg())


@pytest.mark.parametrize(
    ("source", "dest", "refused"),
    [
        ("/data", "/data", "DEST /data is inside SOURCE /data"),
        ("/data", "/data/copy", "DEST /data/copy is inside SOURCE /data"),
        ("/", "/x", "DEST /x is inside SOURCE /"),
        ("/data/copy", "/data", "SOURCE /data/copy is inside DEST /data"),
        ("/data/a/b.bin", "/data", "SOURCE /data/a/b.bin is inside DEST /data"),
        ("/x", "/", "SOURCE /x is inside DEST /"),
        ("/data", "/data-copy", None),
        ("/data-copy", "/data", None),
        ("/data", "/other", None),
    ],
)
def test_dest_and_source_inside_each_other_are_refused(source: str, dest: str, refused: str | None) -> None:
    if refused:
        with pytest.raises(UsageError, match=f"^{refused};"):
            check_overlap(source, dest)
    else:
        check_overlap(source, dest)
