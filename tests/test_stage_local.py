"""A local SOURCE under `mpiexec -n 4`: one reader, everyone else receives over MPI."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools.datasets import tricky_tree
from tests.conftest import REPO, assert_copies, run_cli, tree_of

RANKS = 4
AUDIT = [str(REPO / "tests" / "programs" / "audit_opens.py")]


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """The tricky tree (edge sizes, nested, unicode and spaced names) as a local directory."""
    root = tmp_path_factory.mktemp("src") / "dataset"
    tree = {name[len("ds/") :]: data for name, data in tricky_tree("ds", chunk=1 * MiB, block=4 * MiB).items()}
    for rel, data in tree.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root, tree


def _total_seconds(stdout: str) -> float:
    match = re.search(r"^\[total\] T=([0-9.]+)s$", stdout, re.M)
    assert match, stdout
    return float(match.group(1))


def test_tree_reaches_every_rank_and_a_rerun_is_a_fast_no_op(
    source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, tree = source_tree
    args = [str(root), str(tmp_path / "{rank}"), "--bcast-chunk", "1MiB", "--shard-size", "2MiB"]
    first = run_cli(args, json_path=tmp_path / "first.json")
    assert first.returncode == 0, first.output
    assert_copies(tmp_path, tree)
    doc = first.json
    assert doc is not None
    assert doc["files"] == len(tree) and doc["bytes"] == sum(map(len, tree.values()))
    assert doc["source_rank"] == 0 and doc["downloaded_bytes"] == 0
    assert doc["broadcast_bytes"] == doc["bytes"]
    assert "[cluster] 4 ranks on 1 host, 4 copies, source read by rank 0" in first.stdout
    assert f"[diff] {len(tree)} to transfer (0 peer, {len(tree)} source), 0 skipped" in first.stdout
    second = run_cli(args, json_path=tmp_path / "second.json")
    assert second.returncode == 0, second.output
    assert second.json is not None
    assert second.json["broadcast_bytes"] == 0 and second.json["skipped_files"] == second.json["files"]
    # Fast: no byte moved (above), and a bound on its time, loose because 4 ranks on 2 loaded
    # cores stretch every agreement (it takes about 0.1 s here).
    assert _total_seconds(second.stdout) < 2.0, second.stdout
    assert_copies(tmp_path, tree)


def test_single_file_source(source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    root, tree = source_tree
    name = max(tree, key=lambda k: len(tree[k]))
    result = run_cli([str(root / name), str(tmp_path / "{rank}"), "--bcast-chunk", "1MiB"])
    assert result.returncode == 0, result.output
    assert_copies(tmp_path, {os.path.basename(name): tree[name]})


@pytest.mark.parametrize("source_rank", [None, 2])
def test_only_the_reader_opens_the_source(
    source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path, source_rank: int | None
) -> None:
    root, tree = source_tree
    logs = tmp_path / "logs"
    logs.mkdir()
    extra = [] if source_rank is None else ["--source-rank", str(source_rank)]
    result = run_cli(
        [str(root), str(tmp_path / "d" / "{rank}"), "--bcast-chunk", "1MiB", *extra],
        env={"AZCP_AUDIT_WATCH": str(root), "AZCP_AUDIT_LOG": str(logs)},
        program=AUDIT,
    )
    assert result.returncode == 0, result.output
    assert_copies(tmp_path / "d", tree)
    reader = 0 if source_rank is None else source_rank
    opened = {r: (logs / f"rank-{r}.log").read_text() if (logs / f"rank-{r}.log").exists() else "" for r in range(4)}
    assert all(opened[r] == "" for r in range(RANKS) if r != reader), opened
    # The instrument sees the reader's opens: every non-empty file, and the walk of the tree.
    read = {line.split(" ", 1)[1] for line in opened[reader].splitlines() if line.startswith("open ")}
    wanted = {os.path.realpath(root / rel) for rel, data in tree.items() if data}
    assert wanted <= read, sorted(wanted - read)
    assert f"os.scandir {os.path.realpath(root)}" in opened[reader]


def test_two_source_readers_on_three_nodes_read_half_each_and_nobody_else_opens_it(
    source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """--source-readers 2: the lowest rank of each of the first two nodes reads a balanced,
    disjoint part (LPT over files and 256 KiB shards), each the root of its own transfers."""
    root, tree = source_tree
    logs = tmp_path / "logs"
    logs.mkdir()
    result = run_cli(
        [
            str(root),
            str(tmp_path / "d" / "{rank}"),
            "--bcast-chunk",
            "1MiB",
            "--shard-size",
            "256KiB",
            "--source-readers",
            "2",
            "--no-progress",
        ],
        n=3,
        env={"AZCP_AUDIT_WATCH": str(root), "AZCP_AUDIT_LOG": str(logs)},
        program=AUDIT,
        json_path=tmp_path / "r.json",
    )
    assert result.returncode == 0, result.output
    assert_copies(tmp_path / "d", tree, ranks=3)
    assert "source read by ranks 0, 1" in result.stdout
    opened = {r: (logs / f"rank-{r}.log").read_text() if (logs / f"rank-{r}.log").exists() else "" for r in range(3)}
    assert opened[2] == "", opened[2]
    assert all("open " in opened[r] for r in (0, 1)), opened
    assert result.json is not None and result.json["source_readers"] == [0, 1]
    read = result.json["source_bytes_by_rank"]
    total = sum(len(data) for data in tree.values())
    assert read[2] == 0 and read[0] + read[1] == total  # disjoint: every byte read once
    assert all(abs(read[r] - total / 2) <= 0.1 * total / 2 for r in (0, 1)), read


def test_source_readers_need_as_many_nodes_that_see_it(
    source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, _ = source_tree
    result = run_cli([str(root), str(tmp_path / "one"), "--source-readers", "2", "--no-progress"], n=2)
    assert result.returncode == 2, result.output
    assert "--source-readers 2: only 1 node(s) see SOURCE" in result.stderr


def test_one_node_without_placeholder_has_one_writer(
    source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, tree = source_tree
    dest = tmp_path / "one-node"
    result = run_cli([str(root), str(dest), "--bcast-chunk", "1MiB"], json_path=tmp_path / "r.json")
    assert result.returncode == 0, result.output
    assert "[cluster] 4 ranks on 1 host, 1 copy," in result.stdout
    assert result.json is not None and (result.json["nodes"], result.json["ranks"], result.json["writers"]) == (1, 4, 1)
    got = tree_of(dest)
    assert got == tree
    assert not [p for p in dest.rglob("*") if p.name.endswith(".azcp-part")]


def test_a_file_one_rank_lacks_comes_from_a_peer(source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    root, tree = source_tree
    args = [str(root), str(tmp_path / "{rank}"), "--bcast-chunk", "1MiB"]
    assert run_cli(args).returncode == 0
    victim = next(rel for rel, data in tree.items() if len(data) > 4096)
    (tmp_path / "3" / victim).unlink()
    result = run_cli(args, json_path=tmp_path / "r.json")
    assert result.returncode == 0, result.output
    assert "[diff] 1 to transfer (1 peer, 0 source)" in result.stdout
    assert result.json is not None and result.json["broadcast_bytes"] == len(tree[victim])
    assert_copies(tmp_path, tree)


def test_verify_and_compare_etag_on_a_local_source(source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    root, tree = source_tree
    args = [str(root), str(tmp_path / "{rank}"), "--bcast-chunk", "1MiB", "--compare", "etag"]
    first = run_cli([*args, "--verify"])
    assert first.returncode == 0, first.output
    assert f"[verify] {len(tree)} files" in first.stdout
    # Touching a source file changes its stand-in ETag: only that file moves again.
    victim = next(rel for rel, data in tree.items() if data)
    os.utime(root / victim, ns=(10**18, 10**18))
    second = run_cli(args)
    assert second.returncode == 0, second.output
    assert "[diff] 1 to transfer" in second.stdout
    assert_copies(tmp_path, tree)


def test_compare_etag_sees_a_rewrite_that_keeps_size_and_mtime(tmp_path: Path) -> None:
    # cp -p of a new version over a file: the size and mtime are the old file's. Its change
    # time is not, and --compare etag copies it again (with size and mtime alone it kept the old).
    root = tmp_path / "src"
    root.mkdir()
    files = {"a.bin": b"old version", "b.bin": b"unchanged"}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    args = [str(root), str(tmp_path / "{rank}"), "--compare", "etag"]
    assert run_cli(args, n=2).returncode == 0
    before = (root / "a.bin").stat()
    files["a.bin"] = b"new version"
    (root / "a.bin").write_bytes(files["a.bin"])
    os.utime(root / "a.bin", ns=(before.st_atime_ns, before.st_mtime_ns))
    again = run_cli(args, n=2)
    assert again.returncode == 0, again.output
    assert "[diff] 1 to transfer" in again.stdout, again.stdout
    assert_copies(tmp_path, files, ranks=2)


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["{missing}", "{dest}"], 2, "neither a blob URL nor a path that exists"),
        (["{root}", "{dest}", "--source-rank", "9"], 2, "not a rank of this job"),
        (["{root}", "{root}/inside"], 2, "inside SOURCE"),
        # A download option with a local SOURCE: it read uncapped, exit 0.
        (["{root}", "{dest}", "--max-bandwidth", "1Gbps"], 2, "--max-bandwidth is for a blob URL SOURCE only"),
    ],
    ids=["missing", "source-rank-out-of-range", "dest-inside-source", "download-option"],
)
def test_bad_local_sources(
    source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path, args: list[str], code: int, words: str
) -> None:
    root, _ = source_tree
    filled = [
        a.format(missing=tmp_path / "nope", dest=tmp_path / "d" / "{rank}", root=root) if "{" in a else a for a in args
    ]
    result = run_cli(filled)
    assert result.returncode == code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert "Traceback" not in result.output
    assert not (root / "inside").exists()


@pytest.mark.parametrize(
    ("case", "code"),
    [("dest-inside-source", 2), ("empty-source", 3), ("dry-run", 0), ("copy", 0)],
)
def test_the_json_report_holds_the_peak_memory_of_a_failed_run_too(
    source_tree: tuple[Path, dict[str, bytes]], tmp_path: Path, case: str, code: int
) -> None:
    """``peak_rss_bytes``: every rank's peak memory, as the last agreement carried it, whether
    the run failed in setup (exit 2) or in the listing (exit 3), was a dry run, or copied."""
    root, _ = source_tree
    (tmp_path / "empty").mkdir()
    source = {"empty-source": tmp_path / "empty"}.get(case, root)
    dest = root / "inside" if case == "dest-inside-source" else tmp_path / "d" / "{rank}"
    extra = ["--dry-run"] if case == "dry-run" else []
    result = run_cli([str(source), str(dest), "--no-progress", *extra], n=2, json_path=tmp_path / "r.json")
    assert result.returncode == code, result.output
    assert result.json is not None and result.json["exit_code"] == code
    # An interpreter with mpi4py and numpy: tens of MiB; far from a leak's gigabytes.
    assert 16 * MiB < result.json["peak_rss_bytes"] < 2048 * MiB, result.json["peak_rss_bytes"]
