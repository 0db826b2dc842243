"""Tests for the destination-tree helpers (azcp_cluster/dest/localfs.py): pure path rules, then real files."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.errors import LocalFSError
from azcp_cluster.dest import localfs
from azcp_cluster.dest.localfs import (
    TEMP_SUFFIX,
    expand_dest,
    final_path,
    preallocate,
    pwritev_all,
    temp_path,
)
from tests.conftest import bind_mount

# ---------------------------------------------------------------------------------------
# expand_dest


@pytest.mark.parametrize(
    ("template", "rank", "host", "expected"),
    [
        ("/scratch/data", 3, "node1", "/scratch/data"),
        ("/scratch/{rank}", 3, "node1", "/scratch/3"),
        ("/scratch/{host}/r{rank}", 12, "gpu-7", "/scratch/gpu-7/r12"),
        ("/{rank}/{rank}", 0, "h", "/0/0"),
        ("/scratch/{other}/{RANK}/{ rank }", 1, "h", "/scratch/{other}/{RANK}/{ rank }"),
        ("/d/{host}", 5, "weird{rank}host", "/d/weird{rank}host"),  # a host name is not expanded again
    ],
)
def test_expand_dest(template: str, rank: int, host: str, expected: str) -> None:
    assert expand_dest(template, rank, host) == expected


@given(
    st.lists(st.sampled_from(["/a", "{rank}", "{host}", "-", "{x}"]), max_size=8).map("".join),
    st.integers(0, 4096),
    st.text(st.sampled_from("abcxyz-.0123"), min_size=1, max_size=12),
)
@settings(max_examples=150)
def test_expand_dest_replaces_every_placeholder(template: str, rank: int, host: str) -> None:
    out = expand_dest(template, rank, host)
    assert "{rank}" not in out and "{host}" not in out
    expected = template.replace("{rank}", "\0R").replace("{host}", "\0H").replace("\0R", str(rank)).replace("\0H", host)
    assert out == expected


# ---------------------------------------------------------------------------------------
# final_path / temp_path


def test_paths_examples() -> None:
    assert final_path("/d", "a/b/c.bin") == "/d/a/b/c.bin"
    assert final_path("/d/", "c.bin") == "/d/c.bin"
    assert temp_path("/d", "a/b/c.bin") == f"/d/a/b/.c.bin{TEMP_SUFFIX}"
    assert temp_path("/d", "c.bin") == f"/d/.c.bin{TEMP_SUFFIX}"
    assert temp_path("rel", "x") == f"rel/.x{TEMP_SUFFIX}"


segments = st.text(st.sampled_from("abcxyz019_-. é模"), min_size=1, max_size=8).filter(lambda s: s not in (".", ".."))


@given(st.sampled_from(["/dest", "/dest/", "rel/dir", "/"]), st.lists(segments, min_size=1, max_size=5))
@settings(max_examples=200)
def test_temp_sits_next_to_final(dest: str, parts: list[str]) -> None:
    rel = "/".join(parts)
    final = final_path(dest, rel)
    temp = temp_path(dest, rel)
    assert temp != final
    assert os.path.dirname(temp) == os.path.dirname(final)  # same directory: the rename is atomic
    assert os.path.basename(temp) == f".{parts[-1]}{TEMP_SUFFIX}"
    assert os.path.basename(final) == parts[-1]
    assert final.endswith(os.path.join(*parts))
    assert os.path.normpath(final).startswith(os.path.normpath(dest))
    assert temp_path(dest, rel) == temp  # fixed per path: a rerun reuses it


# ---------------------------------------------------------------------------------------
# preallocate (the temporary files themselves: tests/test_desttree.py)


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS])
def test_preallocate_falls_back_to_a_sparse_file_where_the_filesystem_cannot(tmp_path: Path, code: int) -> None:
    import ctypes

    def refuses(fd: int, mode: int, offset: int, length: int) -> int:  # what NFSv3 or a FUSE mount answer
        ctypes.set_errno(code)
        return -1

    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with mock.patch.object(localfs, "_FALLOCATE", refuses):
            assert preallocate(fd, 4 << 20) is False
    finally:
        os.close(fd)
    assert path.stat().st_size == 4 << 20
    assert path.stat().st_blocks * 512 < 4 << 20  # a hole: no emulation that writes every block


def test_fs_error_names_the_cause() -> None:
    err = localfs.fs_error(OSError(errno.ENOSPC, "No space left on device"), "/d/f", "write")
    assert err.one_line() == "azcp-cluster: error [local]: '/d/f': cannot write: no space left on device"
    assert localfs.fs_error(OSError(errno.EACCES, "Permission denied"), "/d", "create DEST").message == (
        "cannot create DEST: Permission denied"
    )


def test_ensure_dest(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    localfs.ensure_dest(str(target))
    assert target.is_dir()
    localfs.ensure_dest(str(tmp_path / "missing"), create=False)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(LocalFSError, match="not a directory"):
        localfs.ensure_dest(str(tmp_path / "file"))


# ---------------------------------------------------------------------------------------
# pwritev_all


def test_pwritev_all_at_an_offset(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"." * 12)
    fd = os.open(path, os.O_RDWR)
    try:
        views = [memoryview(b"ab"), memoryview(b"cde"), memoryview(b""), memoryview(bytearray(b"f"))]
        assert pwritev_all(fd, views, 4) == 6
        assert pwritev_all(fd, [], 0) == 0
    finally:
        os.close(fd)
    assert path.read_bytes() == b"....abcdef.."


def test_pwritev_all_refuses_no_progress(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    try:
        with mock.patch.object(os, "pwritev", return_value=0), pytest.raises(OSError) as info:
            pwritev_all(fd, [b"abc"], 0)
        assert info.value.errno == errno.EIO
    finally:
        os.close(fd)


@given(
    buffers=st.lists(st.binary(max_size=64), min_size=1, max_size=12).filter(lambda b: sum(map(len, b)) > 0),
    cap=st.integers(1, 70),
    offset=st.integers(0, 100),
)
@settings(max_examples=150, deadline=None)
def test_pwritev_all_survives_short_writes(buffers: list[bytes], cap: int, offset: int) -> None:
    """A kernel may write fewer bytes than asked; pwritev_all must loop until every byte is down."""
    real_pwritev = os.pwritev
    calls: list[int] = []

    def short_pwritev(fd: int, views: list[memoryview], at: int) -> int:
        # Write at most ``cap`` bytes of the requested vectors, like a short write would.
        take: list[memoryview] = []
        left = cap
        for view in views:
            if left <= 0:
                break
            take.append(view[:left])
            left -= len(take[-1])
        written = real_pwritev(fd, take, at)
        calls.append(written)
        return written

    data = b"".join(buffers)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "f")
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        try:
            with mock.patch.object(os, "pwritev", short_pwritev):
                assert pwritev_all(fd, buffers, offset) == len(data)
        finally:
            os.close(fd)
        with open(path, "rb") as f:
            content = f.read()
    assert content == b"\0" * offset + data
    assert all(0 < n <= cap for n in calls)
    assert len(calls) == -(-len(data) // cap)


def test_preadv_all_fills_the_buffer_and_stops_at_eof(tmp_path: Path) -> None:
    from azcp_cluster.dest.directio import aligned_buffer
    from azcp_cluster.dest.localfs import preadv_all

    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    buf = aligned_buffer(8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert preadv_all(fd, buf, 100) == 8192
        assert buf.tobytes() == (bytes(range(256)) * 40)[100:8292]
        assert preadv_all(fd, buf, 9000) == 1240  # short only at end of file
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# where a DEST is on its machine (topology.Place)


def test_the_boot_id_names_this_kernel() -> None:
    boot = localfs.machine_id()
    assert boot == localfs.machine_id()
    if os.path.exists(localfs.BOOT_ID):
        assert len(boot) == 36 and boot.count("-") == 4
    with mock.patch.object(localfs, "BOOT_ID", "/nonexistent/boot_id"):
        assert localfs.machine_id() == ""


def test_a_dest_and_a_link_to_it_are_one_directory_and_a_subdirectory_lies_inside(tmp_path: Path) -> None:
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    a = localfs.locate_dest(os.path.realpath(tmp_path / "a"))
    assert localfs.locate_dest(os.path.realpath(tmp_path / "link")) == a
    st = os.stat(tmp_path / "a")
    assert a[0] == f"{st.st_dev}:{st.st_ino}:"
    sub = localfs.locate_dest(os.path.realpath(tmp_path / "a" / "sub"))
    assert sub[1] == a[1] and sub[2] == a[2] + "/sub" and sub[0] != a[0]


def test_a_dest_not_made_yet_is_its_deepest_existing_directory_and_the_rest(tmp_path: Path) -> None:
    st = os.stat(tmp_path)
    here = localfs.locate_dest(str(tmp_path))
    ahead = localfs.locate_dest(str(tmp_path / "x" / "y"))
    assert ahead[0] == f"{st.st_dev}:{st.st_ino}:x/y" and ahead[1] == here[1] and ahead[2] == here[2] + "/x/y"


def test_a_bind_mount_is_the_directory_it_shows_and_lies_where_that_one_lies(tmp_path: Path) -> None:
    (tmp_path / "a" / "sub").mkdir(parents=True)
    real = localfs.locate_dest(str(tmp_path / "a" / "sub"))
    with bind_mount(tmp_path / "a" / "sub", tmp_path / "m" / "b"):
        # Another path, but the same device and inode, and the same path inside its filesystem.
        assert localfs.locate_dest(str(tmp_path / "m" / "b")) == real
        assert localfs.locate_dest(str(tmp_path / "m" / "b" / "new"))[2] == real[2] + "/new"
    assert localfs.locate_dest(str(tmp_path / "m" / "b")) != real  # unmounted: the empty directory again


def test_mountinfo_paths_are_unescaped() -> None:
    assert localfs._unescape(rb"/a\040b\011c\012d\134e") == "/a b\tc\nd\\e"


def test_ensure_dest_names_what_it_made_and_remove_made_takes_only_those_still_empty(tmp_path: Path) -> None:
    dest = tmp_path / "a" / "b" / "c"
    made = localfs.ensure_dest(str(dest))
    assert made.paths == [str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(dest)]
    assert not localfs.ensure_dest(str(dest))  # there already: nothing made
    (tmp_path / "a" / "keep.txt").write_text("someone else's")
    made.remove()
    assert not (tmp_path / "a" / "b").exists()  # c and b were empty
    assert (tmp_path / "a" / "keep.txt").exists()  # a holds a file: it stays, and so does tmp_path


def test_remove_made_leaves_a_directory_that_is_not_the_one_made(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    made = localfs.ensure_dest(str(dest))
    dest.rmdir()
    dest.mkdir()  # another run's DEST now, empty (the one made is held open: another inode)
    made.remove()
    assert dest.is_dir()
    dest.rmdir()
    again = localfs.ensure_dest(str(dest))
    dest.rmdir()
    dest.symlink_to(tmp_path)  # a link at the name is never followed
    again.remove()
    assert dest.is_symlink()
