"""The block journal's I/O (journal.py) on a real directory: what it records, and what a later run believes."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from zlib import crc32

import pytest

from azcp_cluster.core import resume
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.naming import JOURNAL_DIR
from azcp_cluster.dest import journal
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.localfs import temp_name

MiB = 1 << 20
ORIGIN = "http://127.0.0.1:10000/devstoreaccount1/c"
FILES = (
    FileEntry(name="a.bin", path="a.bin", size=8 * MiB, etag='"0x1"'),
    FileEntry(name="dir/b.bin", path="dir/b.bin", size=3 * MiB + 5, etag='"0x2"'),
)


@pytest.fixture()
def dest(tmp_path: Path) -> Iterator[DestTree]:
    os.mkdir(tmp_path / "dest")
    tree = DestTree(str(tmp_path / "dest"), create=True)
    tree.prepare_all([(f.path, f.size) for f in FILES])
    yield tree
    tree.close()


def _write(tree: DestTree, rel: str, offset: int, data: bytes) -> None:
    fd = tree.opener(rel, temp=True)(os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def written(run: journal.Journal, file: int, offset: int, length: int) -> None:
    """Record a range as the writers do: with the CRC-32 of the bytes written there (read back)."""
    head, _, base = FILES[file].path.rpartition("/")
    with open(Path(run.tree.real) / head / temp_name(base), "rb") as fh:
        fh.seek(offset)
        run.written(file, offset, length, crc32(fh.read(length)))


def _flip(tree: DestTree, rel: str, offset: int) -> None:
    """One byte of ``rel``'s temporary file inverted (a disk, a filesystem or another writer)."""
    fd = tree.opener(rel, temp=True)(os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def _running(tree: DestTree, kept: dict[int, journal.Kept] | None = None) -> journal.Journal:
    fd = journal.begin(tree, FILES, kept or {}, ORIGIN)
    assert fd is not None
    return journal.Journal(tree, fd, FILES, ORIGIN, first_id=len(kept or {}), interval=3600, early=None)


def _reopen(tree: DestTree) -> DestTree:
    """A later run: a new handle on DEST, knowing none of the files it made."""
    return DestTree(tree.path, create=True)


def test_recorded_ranges_are_kept_by_the_next_run(dest: DestTree) -> None:
    run = _running(dest)
    _write(dest, "a.bin", 0, b"x" * 4 * MiB)
    written(run, 0, 0, 4 * MiB)
    _write(dest, "dir/b.bin", MiB, b"y" * (2 * MiB + 5))
    written(run, 1, MiB, 2 * MiB + 5)
    run.close()
    later = _reopen(dest)
    kept = journal.load(later, FILES, [0, 1], ORIGIN)
    assert kept[0].spans == ((0, 4 * MiB),) and kept[0].identity == dest.made["a.bin"]
    assert kept[1].spans == ((MiB, 3 * MiB + 5),)
    assert journal.load(later, FILES, [1], ORIGIN).keys() == {1}  # only the files asked about
    assert journal.load(later, FILES, [0, 1], ORIGIN + "x") == {}  # from another SOURCE


def test_a_kept_range_whose_bytes_changed_is_not_kept_and_the_others_are(dest: DestTree) -> None:
    """A rerun reads every claimed range back: one whose bytes no longer have the recorded
    CRC-32 (a byte flipped on the disk after it was written) is fetched again, not trusted
    and sent on; the ranges around it stay kept, and begin() writes only what was checked."""
    run = _running(dest)
    _write(dest, "a.bin", 0, os.urandom(4 * MiB))
    for i in range(4):
        written(run, 0, i * MiB, MiB)
    run.close()
    _flip(dest, "a.bin", MiB + 100)
    later = _reopen(dest)
    kept = journal.load(later, FILES, [0], ORIGIN)
    assert kept[0].spans == ((0, MiB), (2 * MiB, 4 * MiB))
    assert [(c.offset, c.length) for c in kept[0].claims] == [(0, MiB), (2 * MiB, MiB), (3 * MiB, MiB)]
    fd = journal.begin(later, FILES, kept, ORIGIN)
    assert fd is not None
    os.close(fd)
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN) == kept  # the rewrite carries the CRCs
    _flip(dest, "a.bin", 3 * MiB)  # and they are checked again the next time
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN)[0].spans == ((0, MiB), (2 * MiB, 3 * MiB))


def test_a_claim_past_the_bytes_there_or_with_another_crc_is_not_kept(dest: DestTree) -> None:
    run = _running(dest)
    _write(dest, "dir/b.bin", 0, os.urandom(FILES[1].size))
    run.written(1, 0, MiB, crc32(b"not these bytes"))
    written(run, 1, MiB, 2 * MiB + 5)
    run.close()
    assert journal.load(_reopen(dest), FILES, [1], ORIGIN)[1].spans == ((MiB, 3 * MiB + 5),)
    os.truncate(Path(dest.real) / "dir" / temp_name("b.bin"), 3 * MiB)  # shorter: not resumed at all
    assert journal.load(_reopen(dest), FILES, [1], ORIGIN) == {}


def test_verify_keeps_only_what_came_from_the_source_on_this_node(dest: DestTree) -> None:
    """A range another node sent carries the CRC of the bytes as they arrived here, which no
    source vouched for (the sender may have read them off a disk that had changed them): kept
    for a plain rerun, not under --verify (received=False), where it is fetched again from a
    node that has it from the source, or downloaded. The flag survives begin()'s rewrite."""
    run = _running(dest)
    _write(dest, "a.bin", 0, os.urandom(2 * MiB))
    written(run, 0, 0, MiB)  # downloaded here
    head, _, base = FILES[0].path.rpartition("/")
    with open(Path(run.tree.real) / head / temp_name(base), "rb") as fh:
        fh.seek(MiB)
        run.written(0, MiB, MiB, crc32(fh.read(MiB)), source=False)  # received from another node
    run.close()
    later = _reopen(dest)
    kept = journal.load(later, FILES, [0], ORIGIN)
    assert kept[0].spans == ((0, 2 * MiB),) and [c.source for c in kept[0].claims] == [True, False]
    assert journal.load(later, FILES, [0], ORIGIN, received=False)[0].spans == ((0, MiB),)
    fd = journal.begin(later, FILES, kept, ORIGIN)
    assert fd is not None
    os.close(fd)
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN, received=False)[0].spans == ((0, MiB),)


def test_nothing_is_claimed_before_the_append(dest: DestTree) -> None:
    run = _running(dest)
    written(run, 0, 0, MiB)
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN) == {}  # still pending: not claimed
    run.flush()
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN)[0].spans == ((0, MiB),)
    run.close()


def test_a_temporary_file_made_anew_loses_its_ranges(dest: DestTree) -> None:
    run = _running(dest)
    written(run, 0, 0, MiB)
    run.close()
    # Removed and made again (by hand, or by a run that did not resume it): the inode number
    # may come back, by the same owner; its generation does not.
    path = Path(dest.real) / temp_name("a.bin")
    before = os.stat(path)
    path.unlink()
    with open(path, "wb") as fh:
        fh.truncate(FILES[0].size)
    same_number = os.stat(path).st_ino == before.st_ino
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN) == {}, f"inode number reused: {same_number}"


def test_a_file_of_another_size_or_with_two_links_is_not_resumed(dest: DestTree) -> None:
    run = _running(dest)
    written(run, 0, 0, MiB)
    written(run, 1, 0, MiB)
    run.close()
    os.truncate(Path(dest.real) / temp_name("a.bin"), 5)
    os.link(Path(dest.real) / "dir" / temp_name("b.bin"), Path(dest.real) / "elsewhere")
    assert journal.load(_reopen(dest), FILES, [0, 1], ORIGIN) == {}


@pytest.mark.parametrize(
    ("mode", "links", "uid", "size", "resumable"),
    [
        (stat.S_IFREG | 0o600, 1, os.geteuid(), MiB, True),
        (stat.S_IFLNK | 0o777, 1, os.geteuid(), MiB, False),  # its bytes lie elsewhere
        (stat.S_IFDIR | 0o700, 1, os.geteuid(), MiB, False),
        (stat.S_IFIFO | 0o600, 1, os.geteuid(), MiB, False),
        (stat.S_IFREG | 0o600, 2, os.geteuid(), MiB, False),  # another name may change it
        (stat.S_IFREG | 0o600, 1, os.geteuid() + 1, MiB, False),  # another user's
        (stat.S_IFREG | 0o600, 1, os.geteuid(), MiB - 1, False),  # not the listed size
    ],
)
def test_only_a_regular_file_of_ours_alone_at_the_listed_size_is_resumed(
    mode: int, links: int, uid: int, size: int, resumable: bool
) -> None:
    # A link, a directory or a FIFO hardly ever has a listed file's size on a disk, so the
    # rule is checked on the lstat it reads (journal._resumable), each of its parts alone.
    st = os.stat_result((mode, 1, 1, links, uid, os.getegid(), size, 0, 0, 0))
    assert journal._resumable(st, MiB) is resumable


@pytest.mark.parametrize("spoil", ["group-writable", "hard-linked"])
def test_a_journal_file_others_could_have_written_is_ignored_with_a_warning(
    dest: DestTree, spoil: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _running(dest)
    written(run, 0, 0, MiB)
    run.close()
    journal_file = Path(dest.real) / JOURNAL_DIR / "rank-0"
    if spoil == "group-writable":
        os.chmod(journal_file, 0o620)
    else:
        os.link(journal_file, Path(dest.real) / "copy")
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN) == {}
    assert "cannot be read" in capsys.readouterr().err


def test_a_journal_directory_that_is_a_link_is_not_followed(dest: DestTree, tmp_path: Path) -> None:
    # A directory elsewhere holding a journal that would claim all of a.bin, linked in at the name.
    run = _running(dest)
    written(run, 0, 0, FILES[0].size)
    run.close()
    elsewhere = tmp_path / "elsewhere"
    os.rename(Path(dest.real) / JOURNAL_DIR, elsewhere)
    os.symlink(elsewhere, Path(dest.real) / JOURNAL_DIR)
    later = _reopen(dest)
    assert journal.load(later, FILES, [0], ORIGIN) == {}
    fd = journal.begin(later, FILES, {}, ORIGIN)  # the link is replaced by a directory of our own
    assert fd is not None
    os.close(fd)
    assert not (Path(dest.real) / JOURNAL_DIR).is_symlink()
    assert sorted(os.listdir(elsewhere)) == ["rank-0"], "something was written through the link"


def test_begin_keeps_what_is_kept_and_removes_every_other_journal(dest: DestTree) -> None:
    run = _running(dest)
    written(run, 0, 0, 2 * MiB)
    written(run, 1, 0, MiB)
    run.close()
    other = journal.open_for(dest, 3)  # a node's other downloader
    assert other is not None
    second = journal.Journal(dest, other, FILES, ORIGIN, interval=3600, early=None)
    written(second, 0, 4 * MiB, MiB)
    second.close()
    later = _reopen(dest)
    kept = journal.load(later, FILES, [0, 1], ORIGIN)
    assert kept[0].spans == ((0, 2 * MiB), (4 * MiB, 5 * MiB))
    only_a = {0: kept[0]}
    fd = journal.begin(later, FILES, only_a, ORIGIN)  # b.bin is made anew by this run
    assert fd is not None
    os.close(fd)
    assert os.listdir(Path(dest.real) / JOURNAL_DIR) == ["rank-0"]
    assert journal.load(_reopen(dest), FILES, [0, 1], ORIGIN) == only_a


def test_a_drop_makes_a_path_count_nothing_and_remove_leaves_no_journal(dest: DestTree) -> None:
    run = _running(dest)
    written(run, 0, 0, MiB)
    written(run, 1, 0, MiB)
    run.drop(["a.bin"])
    run.close()
    assert journal.load(_reopen(dest), FILES, [0, 1], ORIGIN).keys() == {1}
    journal.remove(dest)
    assert not (Path(dest.real) / JOURNAL_DIR).exists()
    assert journal.load(_reopen(dest), FILES, [0, 1], ORIGIN) == {}


def test_a_range_of_a_file_this_run_did_not_make_is_never_recorded(dest: DestTree) -> None:
    run = _running(dest)
    dest.made.pop("dir/b.bin")  # renamed already, or never ours
    written(run, 1, 0, MiB)
    written(run, 0, 0, MiB)
    run.close()
    records, readable = resume.decode((Path(dest.real) / JOURNAL_DIR / "rank-0").read_bytes())
    assert readable and {r.path for r in records if isinstance(r, resume.Header)} == {"a.bin"}


def test_a_sync_that_fails_fails_the_copy_and_claims_nothing(dest: DestTree, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel reports a write-back error to the first sync that looks: the journal's sync
    # may be that one, so its failure must fail the copy, not just stop the journal.
    from azcp_cluster.core.errors import LocalFSError

    run = _running(dest)

    def failing(rels: list[str]) -> None:
        raise LocalFSError("sync file: Input/output error", path=dest.shown(rels[0]))

    monkeypatch.setattr(dest, "sync_all", failing)
    written(run, 0, 0, MiB)
    run.flush()  # on the thread, it would be: no traceback, the error kept
    written(run, 0, MiB, MiB)
    with pytest.raises(LocalFSError, match="Input/output error"):
        run.close()
    monkeypatch.undo()
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN) == {}


def test_a_weak_etag_ties_no_block_to_its_file(dest: DestTree) -> None:
    # A local file whose identity cannot be believed (localsource.py: a change time not yet
    # settled, or a filesystem that does not keep one): its blocks are never resumed.
    weak = tuple(f._replace(etag=f"W/{f.etag}") for f in FILES)
    assert journal.tag(weak[0], ORIGIN) == "" and journal.tag(FILES[0], ORIGIN) != ""
    fd = journal.begin(dest, weak, {}, ORIGIN)
    assert fd is not None
    run = journal.Journal(dest, fd, weak, ORIGIN, interval=3600, early=None)
    _write(dest, "a.bin", 0, b"x" * MiB)
    written(run, 0, 0, MiB)
    run.close()
    assert journal.load(_reopen(dest), weak, [0], ORIGIN) == {}


@pytest.mark.parametrize("version", [b"AZCPJNL2", b"AZCPJNL3", b"AZCPJNL4"])
def test_a_journal_of_an_earlier_version_claims_nothing(
    dest: DestTree, capsys: pytest.CaptureFixture[str], version: bytes
) -> None:
    """Version 2 ranges had no CRC (nothing to check a kept range against), version 3 no source
    flag and a shorter record, version 4 a CRC-32C (records like today's, which would be read
    and fail every check): nothing of any is kept, with one warning."""
    run = _running(dest)
    written(run, 0, 0, MiB)
    run.close()
    journal_file = Path(dest.real) / JOURNAL_DIR / "rank-0"
    journal_file.write_bytes(version + journal_file.read_bytes()[len(resume.MAGIC) :])
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN) == {}
    assert "another version of the tool" in capsys.readouterr().err


def test_a_journal_of_the_first_version_claims_nothing(dest: DestTree, capsys: pytest.CaptureFixture[str]) -> None:
    """Version 1 journals came from builds whose fan-out could record a failed root's unfilled
    slot as kept (fanout.Post.intact): the same records under the old magic are not believed."""
    run = _running(dest)
    written(run, 0, 0, MiB)
    run.close()
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN) != {}  # believed under today's magic
    journal_file = Path(dest.real) / JOURNAL_DIR / "rank-0"
    data = journal_file.read_bytes()
    journal_file.write_bytes(b"AZCPJNL1" + data[len(resume.MAGIC) :])
    assert journal.load(_reopen(dest), FILES, [0], ORIGIN) == {}
    assert "another version of the tool" in capsys.readouterr().err


# -- when a running journal takes its turn (resume.turn_due) -------------------------------


def test_a_turn_comes_early_once_enough_was_written_and_not_before(dest: DestTree) -> None:
    """Ranges of 2 MiB against an early turn at 1 MiB are claimed within a few TURN_MIN, with
    the interval an hour away; half a MiB is not, however long the journal waits."""
    fd = journal.begin(dest, FILES, {}, ORIGIN)
    assert fd is not None
    run = journal.Journal(dest, fd, FILES, ORIGIN, interval=3600, early=MiB)
    try:
        written(run, 1, 0, MiB // 2)
        time.sleep(4 * resume.TURN_MIN)
        assert journal.load(_reopen(dest), FILES, [1], ORIGIN) == {}  # under the bytes: no turn
        written(run, 0, 0, 2 * MiB)
        deadline = time.monotonic() + 20 * resume.TURN_MIN
        while time.monotonic() < deadline and not journal.load(_reopen(dest), FILES, [0], ORIGIN):
            time.sleep(resume.TURN_MIN / 5)
        kept = journal.load(_reopen(dest), FILES, [0, 1], ORIGIN)
        assert kept[0].spans == ((0, 2 * MiB),)
        assert kept[1].spans == ((0, MiB // 2),)  # what was pending went with the turn
    finally:
        run.close()


def test_a_turn_comes_by_time_whatever_was_written(dest: DestTree) -> None:
    fd = journal.begin(dest, FILES, {}, ORIGIN)
    assert fd is not None
    run = journal.Journal(dest, fd, FILES, ORIGIN, interval=0.3, early=None)
    try:
        written(run, 0, 0, 4096)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not journal.load(_reopen(dest), FILES, [0], ORIGIN):
            time.sleep(0.05)
        assert journal.load(_reopen(dest), FILES, [0], ORIGIN)[0].spans == ((0, 4096),)
    finally:
        run.close()


def test_the_read_back_of_kept_blocks_stops_at_once_when_told(dest: DestTree) -> None:
    """A signal during the diff stage's read-back (rehash.check_all sets the event as the error
    goes by): a file being read stops at its next piece and keeps nothing."""
    import threading

    from azcp_cluster.dest import rehash

    run = _running(dest)
    _write(dest, "a.bin", 0, os.urandom(4 * MiB))
    written(run, 0, 0, 4 * MiB)
    run.close()
    ident = dest.made["a.bin"]
    (claims,) = [c for r in journal._read_all(dest) for c in [r] if c]
    found = [resume.Claim(x.offset, x.length, x.crc, x.source) for x in claims if isinstance(x, resume.Range)]
    assert rehash.checked(dest, "a.bin", ident, found) == found
    stop = threading.Event()
    stop.set()
    assert rehash.checked(dest, "a.bin", ident, found, stop) == []
