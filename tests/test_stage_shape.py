"""The transfer's shape is decided once (issue 39): in stages/shape.py, handed on by allocate, never decided again.

The decision itself is pure (:func:`shape.decide`), checked over every combination of what it
depends on; the layering is checked statically with ``ast``, as test_purity.py does: no
module but shape.py reads ``--overlap`` or sizes a streamed copy, the transfer stage imports
no function of the allocate stage, and the run's context carries handles, never results.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from azcp_cluster.core.config import Config
from azcp_cluster.core.plan import plan_transfers
from azcp_cluster.core.topology import Topology
from azcp_cluster.core.waves import stream_sizes
from azcp_cluster.stages import shape
from azcp_cluster.stages.setup import Placement

PACKAGE = Path(__file__).resolve().parents[1] / "azcp_cluster"
MiB = 1 << 20


def _place(groups: int) -> Placement:
    """``groups`` nodes of one rank each, every rank a downloader."""
    ranks = tuple(range(groups))
    return Placement(Topology(ranks, ranks, ranks, groups), 0, True, 0, (), None)


@pytest.mark.parametrize(
    ("local", "overlap", "groups", "load", "has_transfers"),
    list(itertools.product([False, True], [False, True], [1, 3], [0, 64 * MiB], [False, True])),
)
def test_a_copy_streams_exactly_when_it_downloads_for_several_nodes_with_overlap_and_has_transfers(
    local: bool, overlap: bool, groups: int, load: int, has_transfers: bool
) -> None:
    cfg = Config(source="https://a.blob.core.windows.net/c", dest="/d", overlap=overlap)
    holders = [[1]] if load == 0 else [[]]  # a file some node holds already moves nothing new
    plan = plan_transfers([load or 1], holders, groups, cfg.shard_size)
    if load == 0:
        plan = plan_transfers([], [], groups, cfg.shard_size)
    got = shape.decide(cfg, local, 0, _place(groups), plan, has_transfers)
    streams = not local and overlap and groups > 1 and load > 0 and has_transfers
    assert got.streamed is streams
    if streams:
        sizes = stream_sizes(max(plan.loads()), cfg.chunk, cfg.block_size, cfg.concurrency)
        assert got.sizes == sizes
        assert got.fetch.block_size == sizes.block
        assert got.fetch.concurrency == max(sizes.in_flight, 1)
        assert got.unit == min(sizes.block, sizes.chunk)
    else:
        assert got.fetch is cfg  # the run's own configuration, untouched
        assert got.unit == cfg.block_size
    assert 1 <= got.workers <= cfg.concurrency


def _sources() -> dict[str, ast.Module]:
    return {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}


def test_only_the_shape_module_decides_whether_a_copy_streams() -> None:
    """``cfg.overlap`` is read, and a streamed copy sized (core.waves.stream_sizes), only in
    stages/shape.py: every caller goes through its ``stream_sizes_for`` / ``decide``."""
    readers: set[str] = set()
    sizers: set[str] = set()
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "overlap" and isinstance(node.ctx, ast.Load):
                readers.add(path)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "stream_sizes":
                sizers.add(path)
    assert readers <= {"stages/shape.py", "run/report.py"}, readers  # the report prints the mode it was told
    assert sizers == {"stages/shape.py"}, sizers


def test_the_transfer_stage_imports_no_function_of_the_allocate_stage() -> None:
    tree = _sources()["stages/transfer.py"]
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "azcp_cluster.stages.allocate":
            imported.update(alias.name for alias in node.names)
        if isinstance(node, ast.ImportFrom) and node.module == "azcp_cluster.stages":
            assert "allocate" not in {alias.name for alias in node.names}
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "allocate":
            raise AssertionError(f"transfer.py calls allocate.{node.attr}")
    assert imported <= {"Prepared"}, imported


def test_the_send_again_round_is_a_loop_of_the_pipeline_not_a_stage_inside_another() -> None:
    """No stage module calls allocate.resend or transfer.move: pipeline.execute does."""
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            runs = isinstance(node, ast.Attribute) and node.attr in ("resend", "move") and path != "pipeline.py"
            if runs and isinstance(node.value, ast.Name) and node.value.id in ("allocate", "transfer"):
                raise AssertionError(f"{path} runs {node.value.id}.{node.attr}")


# The context's fields: facts fixed at the start and handles closed at the end; a new one is
# either, and is added here with its kind, or it is a result and travels as a frozen value.
CONTEXT_FIELDS = {
    # facts
    "cfg", "cluster", "record", "env", "wall", "out", "host", "started", "credential", "rank",
    "dest", "dest_identity", "show_progress", "local", "source_root", "origin",
    # handles
    "tree", "dest_lock", "dest_made", "io", "heap", "_node_comm", "_group_comm", "_warned_direct", "console",
}  # fmt: skip


def test_the_run_context_holds_facts_and_handles_never_results() -> None:
    tree = _sources()["stages/context.py"]
    assigned: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                on_self = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                if on_self and target.value.id == "self":  # type: ignore[attr-defined]
                    assigned.add(target.attr)  # type: ignore[attr-defined]
    assert assigned == CONTEXT_FIELDS


MAX_ANY = 40  # issue 39: 81 before the communicators and the stages' figures were typed


def test_the_package_names_any_at_most_max_any_times() -> None:
    """``typing.Any`` is where the type checker stops following a value: a few are honest (a JSON
    document, the Azure SDK's objects), most were an untyped communicator or a stage's dict."""
    count = sum(
        1
        for tree in _sources().values()
        for node in ast.walk(tree)
        if (isinstance(node, ast.Name) and node.id == "Any") or (isinstance(node, ast.Attribute) and node.attr == "Any")
    )
    assert count <= MAX_ANY, count
