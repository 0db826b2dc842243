"""--dry-run's file list and --delete, end to end under a real mpiexec, each rank a node with its
own DEST (DEST/node{rank}): the dry run lists exactly what the real run then copies and
removes, on every node; and nothing is removed through a link, outside DEST's tree, in a
DEST another run holds, or after a copy that failed on any node."""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

import pytest

from azcp_cluster.core.naming import JOURNAL_DIR, LOCK_NAME
from azcp_cluster.devtools import azurite, demo
from tests.conftest import Result, run_cli

NODES = 2


def _write(path: Path, data: bytes = b"stale") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every name below ``root`` (links not followed) -> (inode, mtime): what a run changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[path.relative_to(root).as_posix()] = (st.st_ino, st.st_mtime_ns)
    return out


def _listed(result: Result) -> dict[str, set[str]]:
    """The dry run's lines by action: action -> the paths (the line's rest after three columns)."""
    actions: dict[str, set[str]] = {}
    for line in result.stdout.splitlines():
        words = line.split(maxsplit=4)  # action, size, unit ("B" too: "10 B"), nodes, path
        if words and words[0] in ("new", "peer", "resume", "skip", "delete"):
            actions.setdefault(words[0], set()).add(words[4])
    return actions


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for name, data in {"a/x.bin": b"1" * 3000, "b/y.bin": b"2" * 10, "z.txt": b"3", "keep.log": b"4"}.items():
        _write(src / name, data)
    return src


def _dests(tmp_path: Path) -> tuple[str, list[Path]]:
    """DEST/node{rank} with a different stale set on each node, and one file already copied on node 1."""
    template = str(tmp_path / "dest" / "node{rank}")
    nodes = [tmp_path / "dest" / f"node{rank}" for rank in range(NODES)]
    _write(nodes[0] / "old" / "deep" / "gone.bin")
    _write(nodes[0] / "a" / "old.bin")
    _write(nodes[1] / "removed.bin")
    _write(nodes[1] / "z.txt", b"3")  # present: a peer copy for node 0
    for node in nodes:
        _write(node / "notes.log")  # excluded by the filters: never a candidate
    return template, nodes


def _run(src: Path, template: str, *extra: str, json_path: Path | None = None) -> Result:
    return run_cli([str(src), template, "--no-progress", "--exclude", "*.log", *extra], n=NODES, json_path=json_path)


def test_delete_removes_on_every_node_exactly_what_the_dry_run_listed(tmp_path: Path) -> None:
    src = _source(tmp_path)
    template, nodes = _dests(tmp_path)
    dry = _run(src, template, "--delete", "--dry-run")
    assert dry.returncode == 0, dry.output
    listed = _listed(dry)
    assert listed["delete"] == {"old/deep/gone.bin", "a/old.bin", "removed.bin"}
    assert "delete          5 B  1/2  removed.bin" in dry.stdout.splitlines()
    assert listed["peer"] == {"z.txt"} and listed["new"] == {"a/x.bin", "b/y.bin"}
    assert "[dry-run] 3 files: 2 new (2.94 KiB), 1 peer (1 B); 3 delete (15 B) on 2 copies" in dry.stdout
    before = [_files(node) for node in nodes]

    real = _run(src, template, "--delete", json_path=tmp_path / "r.json")
    assert real.returncode == 0, real.output
    assert real.json is not None
    assert real.json["deleted_paths"] == sorted(listed["delete"])
    assert (real.json["deleted_files"], real.json["deleted_bytes"], real.json["deleted_copies"]) == (3, 15, 2)
    assert real.json["deleted_distinct_files"] == 3
    assert "[delete] 3 files not in SOURCE removed from 2 copies, 15 bytes in all (15 B)" in real.stdout
    # On each node the files the dry run listed there, and the directories their removal emptied; nothing else.
    gone = [{"old/deep/gone.bin", "a/old.bin", "old/deep", "old"}, {"removed.bin"}]
    for node, was, expected in zip(nodes, before, gone, strict=True):
        now = _files(node)
        assert {rel for rel in was if rel not in now} == expected
        assert (node / "notes.log").exists() and (node / "a" / "x.bin").read_bytes() == b"1" * 3000
    assert not (nodes[0] / "old").exists() and not (nodes[1] / "removed.bin").exists()
    # A rerun finds nothing left to remove and says nothing of deleting.
    again = _run(src, template, "--delete", "--dry-run")
    assert "delete" not in _listed(again) and "[delete]" not in _run(src, template, "--delete").stdout


def test_without_delete_nothing_is_listed_for_removal_nor_removed(tmp_path: Path) -> None:
    src = _source(tmp_path)
    template, nodes = _dests(tmp_path)
    dry = _run(src, template, "--dry-run")
    assert dry.returncode == 0 and "delete" not in _listed(dry)
    assert _run(src, template).returncode == 0
    assert (nodes[0] / "old" / "deep" / "gone.bin").exists() and (nodes[1] / "removed.bin").exists()


def test_links_and_what_lies_outside_dest_are_never_touched(tmp_path: Path) -> None:
    src = _source(tmp_path)
    template, nodes = _dests(tmp_path)
    outside = tmp_path / "outside"
    _write(outside / "dir" / "victim.bin")
    _write(outside / "file.bin")
    beside = _write(tmp_path / "dest" / "beside.bin")  # next to the DESTs, in their parent
    for node in nodes:
        os.symlink(outside / "dir", node / "linkdir")  # a symlinked directory: not descended
        os.symlink(outside / "file.bin", node / "linkfile.bin")  # a symlink: left alone
        (node / "a").mkdir(exist_ok=True)
        os.symlink("../../../outside", node / "a" / "up")  # relative, up and out of DEST
    assert (nodes[0] / "a" / "up" / "file.bin").exists() and (nodes[0] / "linkdir" / "victim.bin").exists()
    dry = _run(src, template, "--delete", "--dry-run")
    assert dry.returncode == 0 and _listed(dry)["delete"] == {"a/old.bin", "old/deep/gone.bin", "removed.bin"}
    real = _run(src, template, "--delete", json_path=tmp_path / "r.json")
    assert real.returncode == 0, real.output
    assert real.json is not None and real.json["deleted_paths"] == ["a/old.bin", "old/deep/gone.bin", "removed.bin"]
    assert real.json["deleted_kept"] == 0
    assert (outside / "dir" / "victim.bin").read_bytes() == b"stale" and (outside / "file.bin").exists()
    assert beside.exists()
    for node in nodes:
        assert (
            (node / "linkdir").is_symlink()
            and (node / "linkfile.bin").is_symlink()
            and (node / "a" / "up").is_symlink()
        )


def test_nothing_is_removed_from_any_node_while_another_run_holds_one_dest(tmp_path: Path) -> None:
    src = _source(tmp_path)
    template, nodes = _dests(tmp_path)
    before = [_files(node) for node in nodes]
    fd = os.open(nodes[1] / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"another run\n")
        real = _run(src, template, "--delete", "--lock", "fail")
    finally:
        os.close(fd)
    assert real.returncode == 9, real.output
    assert "in use by another run" in real.stderr and "Traceback" not in real.output
    for node, was in zip(nodes, before, strict=True):
        now = _files(node)
        assert {rel for rel in was if rel != LOCK_NAME} <= set(now)


def test_nothing_is_removed_from_any_node_after_a_copy_that_failed_on_one(tmp_path: Path) -> None:
    src = _source(tmp_path)
    template, nodes = _dests(tmp_path)
    # Node 1 cannot give b/y.bin its final name (a directory with a file in it stands there):
    # its rename fails after node 0's succeeded, the last moment a copy can fail.
    _write(nodes[1] / "b" / "y.bin" / "inside.log")  # excluded: not a candidate either
    before = [_files(node) for node in nodes]
    real = _run(src, template, "--delete", json_path=tmp_path / "r.json")
    assert real.returncode == 8, real.output
    assert "cannot finish file: Is a directory" in real.stderr and "Traceback" not in real.output
    assert real.json is not None and real.json["deleted_files"] == 0 and "[delete]" not in real.stdout
    for node, was in zip(nodes, before, strict=True):
        assert set(was) <= set(_files(node)), f"{node.name} lost a file"


def test_nothing_behind_a_dangling_link_of_source_is_removed(tmp_path: Path) -> None:
    # SOURCE/model links to a share; the share is away for a moment (unmounted) at the rerun:
    # what lies behind the link is unknown, not gone, and its copies stay on every node.
    src, share = _source(tmp_path), tmp_path / "share"
    _write(share / "model" / "weights.bin", b"w")
    os.symlink(share / "model", src / "model")
    template, nodes = _dests(tmp_path)
    assert _run(src, template).returncode == 0
    share.rename(tmp_path / "share.away")
    dry = _run(src, template, "--delete", "--dry-run")
    assert dry.returncode == 0 and _listed(dry)["delete"] == {"old/deep/gone.bin", "a/old.bin", "removed.bin"}
    real = _run(src, template, "--delete", json_path=tmp_path / "r.json")
    assert real.returncode == 0, real.output
    assert real.json is not None and real.json["deleted_paths"] == ["a/old.bin", "old/deep/gone.bin", "removed.bin"]
    assert "--delete kept 2 file(s) under dangling link(s) in SOURCE (e.g. 'model'), in 2 copies" in real.stderr
    for node in nodes:
        assert (node / "model" / "weights.bin").read_bytes() == b"w"


def test_a_directory_source_also_has_under_another_name_is_not_removed(tmp_path: Path) -> None:
    # SOURCE/model is copied; then a link a_alias -> model sorts first and names the listing's
    # files: SOURCE still has model/, and DEST's copy of it stays.
    src = _source(tmp_path)
    _write(src / "model" / "w.bin", b"w")
    template, nodes = _dests(tmp_path)
    assert _run(src, template).returncode == 0
    os.symlink("model", src / "a_alias")
    real = _run(src, template, "--delete", json_path=tmp_path / "r.json")
    assert real.returncode == 0, real.output
    assert real.json is not None and real.json["deleted_paths"] == ["a/old.bin", "old/deep/gone.bin", "removed.bin"]
    for node in nodes:
        assert (node / "model" / "w.bin").read_bytes() == b"w" and (node / "a_alias" / "w.bin").read_bytes() == b"w"


def test_a_nested_dest_whose_run_was_stopped_is_left_alone(tmp_path: Path) -> None:
    # DEST/inner was another run's DEST, stopped: its journal and temporary file, no manifest or lock.
    src = _source(tmp_path)
    template, nodes = _dests(tmp_path)
    for node in nodes:
        _write(node / "inner" / JOURNAL_DIR / "rank-0", b"journal")
        _write(node / "inner" / ".w.bin.azcp-part", b"part")
    before = [_files(node / "inner") for node in nodes]
    real = _run(src, template, "--delete", json_path=tmp_path / "r.json")
    assert real.returncode == 0, real.output
    assert real.json is not None and real.json["deleted_paths"] == ["a/old.bin", "old/deep/gone.bin", "removed.bin"]
    for node, was in zip(nodes, before, strict=True):
        assert _files(node / "inner") == was


def test_delete_with_one_file_as_source_is_refused(tmp_path: Path) -> None:
    src = _write(tmp_path / "one.bin", b"1")
    dest = _write(tmp_path / "dest" / "node0" / "other.bin").parent
    result = run_cli([str(src), str(tmp_path / "dest" / "node{rank}"), "--no-progress", "--delete"], n=NODES)
    assert result.returncode == 2, result.output
    assert "--delete mirrors a directory, but SOURCE names one file" in result.stderr
    assert "Traceback" not in result.output
    assert (dest / "other.bin").exists()


@pytest.fixture(scope="module")
def demo_dataset(emulator: azurite.Emulator) -> str:
    """The demo's dataset (devtools/demo.checkpoint_like) in a container of its own."""
    container = f"demo-{uuid.uuid4().hex[:8]}"
    azurite.upload(emulator, container, demo.checkpoint_like(2 << 20))
    return container


def test_the_dry_run_lists_exactly_what_the_real_run_copies_on_the_demos_dataset(
    emulator: azurite.Emulator, demo_dataset: str, tmp_path: Path
) -> None:
    template = str(tmp_path / "node{rank}")
    nodes = [tmp_path / f"node{rank}" for rank in range(NODES)]
    blobs = demo.checkpoint_like(2 << 20)
    # Every node has the config already, node 1 the tokenizer, and each node a stale file.
    for node in nodes:
        _write(node / "config.json", blobs["llama-tiny/config.json"])
    _write(nodes[1] / "tokenizer" / "tokenizer.json", blobs["llama-tiny/tokenizer/tokenizer.json"])
    _write(nodes[1] / "extra" / "part-99.bin")
    _write(nodes[0] / "model-00009-of-00009.safetensors")
    args = [emulator.url(demo_dataset, "llama-tiny"), template, "--no-progress", "--delete"]
    args += ["--include", "*.safetensors", "--include", "extra/*", "--include", "*.json", "--exclude", "extra/part-1*"]
    dry = run_cli([*args, "--dry-run"], n=NODES, env=emulator.key_env())
    assert dry.returncode == 0, dry.output
    listed = _listed(dry)
    copied_listed = listed["new"] | listed.get("peer", set()) | listed.get("resume", set())
    assert listed["skip"] == {"config.json"} and listed["peer"] == {"tokenizer/tokenizer.json"}
    before = [_files(node) for node in nodes]

    real = run_cli(args, n=NODES, env=emulator.key_env(), json_path=tmp_path / "r.json")
    assert real.returncode == 0, real.output
    written = set()
    for node, was in zip(nodes, before, strict=True):
        now = _files(node)
        written |= {rel for rel, ident in now.items() if was.get(rel) != ident and not (node / rel).is_dir()}
    written.discard(".azcp-manifest.json")
    assert written == copied_listed  # every file the dry run said moves, and no other, was written
    assert real.json is not None
    assert (
        set(real.json["deleted_paths"]) == listed["delete"] == {"extra/part-99.bin", "model-00009-of-00009.safetensors"}
    )
    assert real.json["transfer_files"] == len(copied_listed)
    selected = {p.removeprefix("llama-tiny/") for p in blobs}
    selected = {p for p in selected if p.endswith((".safetensors", ".json")) or p.startswith("extra/")}
    selected = {p for p in selected if not p.startswith("extra/part-1")}
    assert copied_listed | listed.get("skip", set()) == selected


def test_delete_with_one_blob_as_source_is_refused(
    emulator: azurite.Emulator, demo_dataset: str, tmp_path: Path
) -> None:
    stale = _write(tmp_path / "node0" / "other.bin")
    args = [emulator.url(demo_dataset, "llama-tiny/config.json"), str(tmp_path / "node{rank}"), "--delete"]
    result = run_cli([*args, "--no-progress"], n=NODES, env=emulator.key_env())
    assert result.returncode == 2, result.output
    assert "--delete mirrors a directory, but SOURCE names one file" in result.stderr
    assert "Traceback" not in result.output
    assert stale.exists()
