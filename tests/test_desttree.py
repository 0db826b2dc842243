"""DEST through a directory handle (azcp_cluster/dest/desttree.py) and its lock (destlock.py), on real files.

The hostile cases are what someone with write access to DEST can put there before or during
a run: a symlink or a FIFO at a temporary name, a symlinked directory, a hard link, a
directory where a file goes. In each, nothing outside DEST may change and nothing may hang.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from azcp_cluster.core.errors import DiffError, LocalFSError, exit_code_for
from azcp_cluster.core.naming import LOCK_NAME
from azcp_cluster.dest import localfs
from azcp_cluster.dest.destlock import FIRST_PAUSE, LONGEST_PAUSE, DestLock, lock_backoff
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectFile, DirectReader
from azcp_cluster.dest.localfs import pwritev_all, temp_path
from tests.conftest import fstype


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside DEST that must never change."""
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    return victim


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    path = tmp_path / "dest"
    path.mkdir()
    return path


def _write(tree: DestTree, rel: str, data: bytes) -> None:
    target = DirectFile(tree.temp_shown(rel), direct=False, opener=tree.opener(rel, temp=True))
    try:
        target.write_at(np.frombuffer(data, dtype=np.uint8), 0)
    finally:
        target.close()


# ---------------------------------------------------------------------------------------
# the ordinary life of a file: prepare, write, finalize, present


def test_prepare_write_finalize_is_present(dest: Path) -> None:
    tree = DestTree(str(dest))
    rel = "deep/er/file.bin"
    assert not tree.is_present(rel, 10)
    tree.prepare(rel, 10)
    temp = Path(temp_path(str(dest), rel))
    assert temp.stat().st_size == 10
    assert not tree.is_present(rel, 10)  # a temporary file never counts
    fd = tree.opener(rel, temp=True)(os.O_WRONLY)
    try:
        assert pwritev_all(fd, [b"0123", b"456789"], 0) == 10
    finally:
        os.close(fd)
    tree.finalize(rel)
    assert not temp.exists()
    assert (dest / rel).read_bytes() == b"0123456789"
    assert tree.is_present(rel, 10)
    assert not tree.is_present(rel, 11)
    assert not tree.is_present("deep/er", 0)  # a directory is not a file
    tree.sync_dirs([rel])


def test_prepare_replaces_a_leftover_temp(dest: Path) -> None:
    tree = DestTree(str(dest))
    temp = Path(temp_path(str(dest), "f"))
    temp.write_bytes(b"x" * 100)
    os.link(temp, dest / "kept")  # a second name keeps the old file visible
    tree.prepare_all([("f", 3), ("empty", 0)])
    assert temp.read_bytes() == b"\0\0\0"
    assert (dest / "kept").read_bytes() == b"x" * 100, "the leftover was replaced, not truncated"
    assert Path(temp_path(str(dest), "empty")).stat().st_size == 0


def test_prepare_reserves_the_blocks_where_the_filesystem_can(dest: Path) -> None:
    size = 8 << 20
    DestTree(str(dest)).prepare("big", size)
    st = os.stat(temp_path(str(dest), "big"))
    assert st.st_size == size
    if fstype(dest) in ("ext4", "xfs", "btrfs", "tmpfs"):
        # Reserved, not a hole: ext4 lets O_DIRECT writes into reserved blocks of one file
        # run at once, and a full disk shows before the download.
        assert st.st_blocks * 512 >= size
    assert Path(temp_path(str(dest), "big")).read_bytes() == bytes(size)  # reads back as zeros


def test_prepare_reports_a_file_too_large_for_the_filesystem(dest: Path) -> None:
    if localfs._FALLOCATE is None:
        pytest.skip("no fallocate(2) in this libc")
    # The kernel refuses before reserving anything (ext4: EFBIG; tmpfs: ENOSPC): exit 8.
    with pytest.raises(LocalFSError) as info:
        DestTree(str(dest)).prepare("huge", 1 << 62)
    assert exit_code_for(info.value) == 8
    assert "cannot create temporary file" in str(info.value)


def test_finalize_replaces_an_old_copy(dest: Path) -> None:
    (dest / "f").write_bytes(b"old!")
    tree = DestTree(str(dest))
    tree.prepare("f", 2)
    tree.finalize("f")
    assert (dest / "f").read_bytes() == b"\0\0"


def test_filesystem_errors_are_local_fs_errors(dest: Path) -> None:
    (dest / "blocker").write_bytes(b"")
    tree = DestTree(str(dest))
    with pytest.raises(LocalFSError, match="not a directory") as info:
        tree.prepare("blocker/child", 1)  # a file stands where a directory is needed
    assert exit_code_for(info.value) == 8
    with pytest.raises(LocalFSError):
        tree.finalize("never-prepared")


def test_a_missing_dest_is_absent_for_a_dry_run_and_an_error_otherwise(tmp_path: Path) -> None:
    tree = DestTree(str(tmp_path / "missing"))
    assert not tree.exists and not tree.is_present("f", 0) and tree.lstat("f") is None
    with pytest.raises(LocalFSError, match="open DEST"):
        DestTree(str(tmp_path / "missing"), create=True)


def test_space_needed_counts_what_leftover_temporary_files_give_back(dest: Path) -> None:
    tree = DestTree(str(dest))
    assert tree.space_needed([("a.bin", 1 << 20), ("sub/b.bin", 4096)]) == (1 << 20) + 4096
    (dest / ".a.bin.azcp-part").write_bytes(b"x" * (1 << 19))  # half of a.bin, from a crashed run
    assert tree.space_needed([("a.bin", 1 << 20)]) == 1 << 19
    (dest / ".a.bin.azcp-part").write_bytes(b"x" * (2 << 20))  # larger than the new size
    assert tree.space_needed([("a.bin", 1 << 20)]) == 0


def test_dest_given_through_a_symlink_is_its_real_path(tmp_path: Path, dest: Path) -> None:
    (tmp_path / "link").symlink_to(dest)
    tree = DestTree(str(tmp_path / "link"))
    assert tree.real == str(dest)
    tree.prepare("f", 1)
    tree.finalize("f")
    assert (dest / "f").exists()


# ---------------------------------------------------------------------------------------
# hostile DEST: links, FIFOs, directories where files go


def test_a_symlink_at_a_temporary_name_is_replaced_not_followed(dest: Path, outside: Path) -> None:
    (dest / ".model.bin.azcp-part").symlink_to(outside)
    tree = DestTree(str(dest))
    tree.prepare("model.bin", 4)
    _write(tree, "model.bin", b"blob")
    tree.finalize("model.bin")
    assert outside.read_bytes() == b"precious"
    assert (dest / "model.bin").read_bytes() == b"blob" and not (dest / "model.bin").is_symlink()


def test_a_symlink_put_at_a_temporary_name_during_the_run_is_refused(dest: Path, outside: Path) -> None:
    tree = DestTree(str(dest))
    tree.prepare("model.bin", 4)
    temp = Path(temp_path(str(dest), "model.bin"))
    temp.unlink()
    temp.symlink_to(outside)  # swapped in after the tool made its file
    with pytest.raises(LocalFSError, match="symbolic link"):
        tree.opener("model.bin", temp=True)(os.O_WRONLY)
    with pytest.raises(LocalFSError, match="symbolic link"):
        tree.finalize("model.bin")
    assert outside.read_bytes() == b"precious"
    assert not (dest / "model.bin").exists()


def test_a_hard_link_at_a_temporary_name_is_never_written_into(dest: Path, outside: Path) -> None:
    tree = DestTree(str(dest))
    tree.prepare("model.bin", 4)
    temp = Path(temp_path(str(dest), "model.bin"))
    temp.unlink()
    os.link(outside, temp)
    with pytest.raises(LocalFSError, match="hard-linked"):
        DirectFile(str(temp), opener=tree.opener("model.bin", temp=True))
    assert outside.read_bytes() == b"precious"
    # At a final name, a hard link is not a copy: it is copied again and replaced by the rename.
    os.link(outside, dest / "weights.bin")
    assert not tree.is_present("weights.bin", len(b"precious"))


def test_a_file_of_someone_else_put_at_a_temporary_name_during_the_run_is_never_used(dest: Path) -> None:
    tree = DestTree(str(dest))
    tree.prepare("model.bin", 4)
    temp = Path(temp_path(str(dest), "model.bin"))
    held = os.open(temp, os.O_RDONLY)  # the run's file stays allocated: its inode is not reused below
    temp.unlink()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # theirs: a plain file, one link
    if os.geteuid() == 0:
        os.fchown(fd, 65534, 65534)  # and made by another user, as someone else's file is
    os.close(fd)
    os.close(held)
    for use in (
        lambda: tree.opener("model.bin", temp=True)(os.O_WRONLY),
        lambda: DirectReader("x", opener=tree.opener("model.bin", temp=True)),
        lambda: tree.sync("model.bin"),
        lambda: tree.rename("model.bin"),
        lambda: tree.finalize("model.bin"),
    ):
        with pytest.raises(LocalFSError, match="not the temporary file this run made"):
            use()
    assert not (dest / "model.bin").exists()
    # A temporary name this handle never made is refused alike; another rank of the node
    # that adopts the maker's identities may use it.
    other = DestTree(str(dest))
    tree.prepare("w.bin", 2)
    with pytest.raises(LocalFSError, match="not the temporary file this run made"):
        other.opener("w.bin", temp=True)(os.O_WRONLY)
    other.adopt(tree.made)
    os.close(other.opener("w.bin", temp=True)(os.O_WRONLY))


def test_a_symlinked_directory_inside_dest_is_refused_and_named(dest: Path, outside: Path) -> None:
    (dest / "sub").symlink_to(outside.parent)
    tree = DestTree(str(dest))
    assert not tree.is_present("sub/victim.txt", len(b"precious"))  # not a copy of ours
    with pytest.raises(LocalFSError, match="symbolic link") as info:
        tree.prepare("sub/victim.txt", 4)
    assert info.value.path == str(dest / "sub") and exit_code_for(info.value) == 8
    assert sorted(p.name for p in outside.parent.iterdir()) == ["victim.txt"]
    assert outside.read_bytes() == b"precious"


def test_a_directory_swapped_for_a_symlink_during_the_run_is_not_written_through(dest: Path, outside: Path) -> None:
    tree = DestTree(str(dest))
    tree.prepare("sub/victim.txt", 8)
    (dest / "sub").rename(dest / "elsewhere")
    (dest / "sub").symlink_to(outside.parent)
    (outside.parent / ".victim.txt.azcp-part").write_bytes(b"theirs!!")
    with pytest.raises(LocalFSError, match="symbolic link"):
        DirectFile(str(dest / "sub"), opener=tree.opener("sub/victim.txt", temp=True))
    with pytest.raises(LocalFSError, match="symbolic link"):
        tree.finalize("sub/victim.txt")
    assert outside.read_bytes() == b"precious"
    assert (outside.parent / ".victim.txt.azcp-part").read_bytes() == b"theirs!!"


def test_a_fifo_at_a_temporary_name_is_removed_and_never_blocks(dest: Path) -> None:
    os.mkfifo(dest / ".a.bin.azcp-part")
    tree = DestTree(str(dest))
    tree.prepare("a.bin", 2)  # removed, then made anew as a regular file
    assert Path(temp_path(str(dest), "a.bin")).is_file()
    os.unlink(temp_path(str(dest), "a.bin"))
    os.mkfifo(temp_path(str(dest), "a.bin"))  # put there during the run: refused at once, no hang
    with pytest.raises(LocalFSError, match="not a regular file"):
        DirectFile("a", opener=tree.opener("a.bin", temp=True))
    with pytest.raises(LocalFSError, match="not a regular file"):
        DirectReader("a", opener=tree.opener("a.bin", temp=True))
    assert not tree.is_present("a.bin", 0)


def test_a_directory_at_a_temporary_name_is_refused(dest: Path) -> None:
    (dest / ".a.bin.azcp-part").mkdir()
    with pytest.raises(LocalFSError, match="directory stands where the copy makes a temporary file"):
        DestTree(str(dest)).prepare("a.bin", 2)


def test_a_symlink_at_a_final_name_is_replaced_by_the_copy(dest: Path, outside: Path) -> None:
    (dest / "model.bin").symlink_to(outside)
    tree = DestTree(str(dest))
    assert not tree.is_present("model.bin", len(b"precious"))  # a link is not a copy
    tree.prepare("model.bin", 4)
    _write(tree, "model.bin", b"blob")
    tree.finalize("model.bin")
    assert outside.read_bytes() == b"precious"
    assert not (dest / "model.bin").is_symlink() and (dest / "model.bin").read_bytes() == b"blob"
    with pytest.raises(LocalFSError):  # and a link at the final name is never read through
        (dest / "other").symlink_to(outside)
        tree.opener("other", temp=False)(os.O_RDONLY)


def test_the_manifest_is_written_anew_never_through_a_link(dest: Path, outside: Path) -> None:
    tree = DestTree(str(dest))
    (dest / ".azcp-manifest.json").symlink_to(outside)
    (dest / "..azcp-manifest.json.azcp-part").symlink_to(outside)
    assert tree.read_small(".azcp-manifest.json", 1 << 20) is None  # not followed
    tree.write_atomic(".azcp-manifest.json", b"{}")
    assert outside.read_bytes() == b"precious"
    assert (dest / ".azcp-manifest.json").read_bytes() == b"{}"
    assert sorted(p.name for p in dest.iterdir()) == [".azcp-manifest.json"]


def test_is_present_reports_an_unreadable_directory_as_an_error(dest: Path) -> None:
    with pytest.raises(DiffError, match="cannot inspect"):
        DestTree(str(dest)).is_present("x" * 300, 1)  # ENAMETOOLONG: neither absent nor present


def test_the_threaded_compare_matches_file_by_file_and_names_the_first_failing_batch(
    dest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import azcp_cluster.dest.destroot as destroot
    from azcp_cluster.dest import syscalls

    monkeypatch.setattr(destroot, "STAT_BATCH", 3)  # many batches, some directories split
    monkeypatch.setattr(syscalls, "SLOW_CALL", 0.0)  # every call "slow": all on threads
    monkeypatch.setattr(syscalls, "CALIBRATE", 0)
    tree = DestTree(str(dest))
    assert tree.present_all([]) == []
    rng = random.Random(5)
    wanted = []
    for i in range(60):
        rel = f"d{i % 4}/f{i}" if i % 5 else f"top{i}"
        size = rng.randrange(3)
        if rng.random() < 0.6:
            (dest / rel).parent.mkdir(exist_ok=True)
            (dest / rel).write_bytes(b"z" * rng.randrange(3))
        wanted.append((rel, size))
    (dest / "d1").mkdir(exist_ok=True)
    (dest / "d1" / "f1").unlink(missing_ok=True)
    (dest / "d1" / "f1").mkdir()  # not a file: absent
    expected = [
        (dest / rel).is_file() and not (dest / rel).is_symlink() and (dest / rel).stat().st_size == size
        for rel, size in wanted
    ]
    assert tree.present_all(wanted) == expected and any(expected) and not all(expected)
    # Two unreadable names (too long): the error names the first, whichever thread saw it first.
    bad = [("d2/" + "x" * 300, 1), *wanted, ("d3/" + "y" * 300, 1)]
    for _ in range(5):
        with pytest.raises(DiffError, match="cannot inspect") as err:
            tree.present_all(bad)
        assert err.value.path is not None and "x" * 300 in err.value.path


# ---------------------------------------------------------------------------------------
# the lock

HOLD = textwrap.dedent(
    """
    import sys, time
    from azcp_cluster.dest.desttree import DestTree
    from azcp_cluster.dest.destlock import DestLock
    lock = DestLock(DestTree(sys.argv[1]), "otherhost pid 4242")
    assert lock.try_acquire() is None
    print("held", flush=True)
    sys.stdin.readline()
    lock.close()
    """
)


def test_the_lock_is_exclusive_between_processes_and_names_its_holder(dest: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(dest)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lock = DestLock(DestTree(str(dest)), "me pid 1")
        assert lock.try_acquire() == "otherhost pid 4242"
        assert not lock.held
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=30) == 0
        assert not (dest / LOCK_NAME).exists(), "the holder removes the lock file at its end"
        # The file this process opened was removed: taking the lock opens the name again.
        assert lock.try_acquire() is None and lock.held
        assert (dest / LOCK_NAME).read_text() == "me pid 1\n"
        lock.close()
        assert not (dest / LOCK_NAME).exists()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_killed_holder_leaves_the_lock_free(dest: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(dest)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait(timeout=30)
    lock = DestLock(DestTree(str(dest)), "me pid 1")
    assert lock.try_acquire() is None  # the kernel released it with the process
    lock.close()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "hardlink", "directory"])
def test_a_lock_name_that_is_not_a_plain_file_is_refused(dest: Path, outside: Path, kind: str) -> None:
    where = dest / LOCK_NAME
    if kind == "symlink":
        where.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(where)
    elif kind == "hardlink":
        os.link(outside, where)
    else:
        where.mkdir()
    with pytest.raises(LocalFSError) as info:
        DestLock(DestTree(str(dest)), "me pid 1")
    assert exit_code_for(info.value) == 8 and info.value.path == str(where)
    assert outside.read_bytes() == b"precious"


def test_a_lock_given_up_removes_its_file_unless_another_run_holds_it(dest: Path) -> None:
    lock = DestLock(DestTree(str(dest)), "me pid 1")
    assert lock.try_acquire() is None
    lock.release()  # refused on another node: given up, the file stays for the next try
    assert (dest / LOCK_NAME).exists()
    lock.close()  # the end of a refused run: nobody holds it, so it goes
    assert not (dest / LOCK_NAME).exists()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(dest)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = DestLock(DestTree(str(dest)), "me pid 1")
        assert refused.try_acquire() == "otherhost pid 4242"
        refused.close()
        assert (dest / LOCK_NAME).read_text() == "otherhost pid 4242\n", "another run's lock file is theirs"
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=30)


def test_lock_backoff_grows_to_its_bound_and_stays_random() -> None:
    rng = random.Random(7)
    pauses = [lock_backoff(attempt, rng) for attempt in range(40)]
    assert all(FIRST_PAUSE / 2 <= p <= LONGEST_PAUSE for p in pauses)
    assert max(pauses[:2]) <= 2 * FIRST_PAUSE and min(pauses[20:]) >= LONGEST_PAUSE / 2
    assert len(set(pauses[20:])) == 20  # jittered: two jobs that collide drift apart


# ---------------------------------------------------------------------------------------
# durability in bulk


def test_many_files_are_made_durable_with_one_syncfs(dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from azcp_cluster.dest import desttree

    tree = DestTree(str(dest))
    rels = [f"d{i % 3}/f{i}.bin" for i in range(desttree.BULK_SYNC + 4)]
    tree.prepare_all([(rel, 10) for rel in rels])
    calls: list[int] = []
    monkeypatch.setattr(desttree, "syncfs", lambda fd: calls.append(fd) is None)
    monkeypatch.setattr(os, "fdatasync", lambda fd: pytest.fail("one fdatasync per file despite syncfs"))
    tree.sync_all(rels)
    assert calls == [tree.fd]
    synced: list[int] = []
    monkeypatch.setattr(os, "fdatasync", synced.append)
    tree.sync_all(rels[:3])  # a few files: one fdatasync each is as cheap
    assert calls == [tree.fd] and len(synced) == 3


def test_without_a_trustworthy_syncfs_each_file_is_synced(dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from azcp_cluster.dest import desttree

    tree = DestTree(str(dest))
    rels = [f"f{i}.bin" for i in range(desttree.BULK_SYNC + 4)]
    tree.prepare_all([(rel, 10) for rel in rels])
    monkeypatch.setattr(desttree, "syncfs", lambda fd: False)  # e.g. Linux before 5.8
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    tree.sync_all(rels)
    assert len(synced) == len(rels)


def test_a_write_back_error_of_syncfs_is_a_local_fs_error(dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from azcp_cluster.dest import desttree

    def failing(fd: int) -> bool:
        raise OSError(errno.EIO, "Input/output error")

    tree = DestTree(str(dest))
    rels = [f"f{i}.bin" for i in range(desttree.BULK_SYNC)]
    tree.prepare_all([(rel, 1) for rel in rels])
    monkeypatch.setattr(desttree, "syncfs", failing)
    with pytest.raises(LocalFSError, match="Input/output error") as info:
        tree.sync_all(rels)
    assert exit_code_for(info.value) == 8


def test_syncfs_is_used_only_where_it_reports_errors(dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = os.open(dest, os.O_RDONLY)
    try:
        release = tuple(int(p) for p in os.uname().release.split(".")[:2])
        assert localfs.syncfs(fd) is (release >= (5, 8))
        monkeypatch.setattr(localfs, "_SYNCFS", None)
        assert localfs.syncfs(fd) is False
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_files_below_a_mount_point_in_dest_are_synced_on_their_own(dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from azcp_cluster.dest import desttree

    (dest / "other").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(dest / "other")], check=True, timeout=30)
    try:
        tree = DestTree(str(dest))
        here = [f"f{i}.bin" for i in range(desttree.BULK_SYNC)]
        there = [f"other/g{i}.bin" for i in range(3)]
        tree.prepare_all([(rel, 10) for rel in here + there])
        calls: list[int] = []
        monkeypatch.setattr(desttree, "syncfs", lambda fd: calls.append(fd) is None)
        synced: list[int] = []
        monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(os.fstat(fd).st_dev))
        tree.sync_all(here + there)
        assert calls == [tree.fd]  # DEST's own filesystem: one syncfs
        assert synced == [os.stat(dest / "other").st_dev] * 3  # the other filesystem: one by one
    finally:
        subprocess.run(["umount", "-l", str(dest / "other")], check=False, timeout=30)


def test_a_waiting_run_whose_dest_was_removed_by_its_maker_is_told_so(tmp_path: Path) -> None:
    """The run that made DEST failed before writing anything and removed it (empty): the one
    waiting for its lock learns that DEST is gone (setup then makes it again), never writes into
    a removed directory."""
    dest = tmp_path / "d"
    dest.mkdir()
    maker_tree, waiter_tree = DestTree(str(dest)), DestTree(str(dest))
    maker, waiter = DestLock(maker_tree, "maker"), DestLock(waiter_tree, "waiter")
    assert maker.try_acquire() is None
    assert waiter.try_acquire() == "maker"
    maker.close()  # removes the lock file while it holds it
    maker_tree.close()
    dest.rmdir()
    assert waiter_tree.removed
    assert waiter.try_acquire() == "the run that made DEST, which has just removed it"
    waiter.close()
    waiter_tree.close()
    assert not dest.exists()
