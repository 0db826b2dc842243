"""The Python API: ``azcp_cluster.stage()`` from an mpi4py program, and its option handling."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import azcp_cluster
from azcp_cluster.api import OPTIONS, coerce, make_config
from azcp_cluster.core.config import Config, MiB
from azcp_cluster.core.errors import AzcpError, UsageError
from tests.conftest import MPI_TIMEOUT, REPO, clean_env, mpiexec_path

PROGRAM = REPO / "tests" / "programs" / "stage_then_train.py"


def test_every_config_field_is_an_option_and_takes_its_default() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(Config) if f.name not in ("source", "dest")}
    assert set(OPTIONS) == set(defaults)
    assert make_config("s", "d", defaults) == Config(source="s", dest="d")


def test_options_are_converted_like_the_command_line() -> None:
    cfg = make_config(
        "s", "d", {"bcast_chunk": "2MiB", "shard_size": 3 * MiB, "include": "*.bin", "exclude": ["a", "b"]}
    )
    assert (cfg.bcast_chunk, cfg.shard_size, cfg.include, cfg.exclude) == (2 * MiB, 3 * MiB, ("*.bin",), ("a", "b"))
    assert make_config("https://a.blob.core.windows.net/c", "d", {"read_timeout": 5}).read_timeout == 5.0


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"bcast_chunks": "1MiB"}, "unknown option(s) bcast_chunks"),
        ({"bcast_chunk": "lots"}, "invalid size"),
        ({"concurrency": "8"}, "option concurrency cannot be '8'"),
        ({"verify": 1}, "option verify cannot be 1"),
        ({"concurrency": True}, "option concurrency cannot be True"),
        ({"include": [1]}, "include must be a glob"),
        ({"compare": "sha"}, "--compare must be one of"),
        ({"bcast_pipeline": 0}, "--bcast-pipeline must be between"),
        ({"download_ranks": 0}, "--download-ranks must be at least 1"),
        # The same ranges as on the command line (Config.validate):
        ({"block_size": "32KiB"}, "--block-size must be between 64.00 KiB and 1.00 GiB"),
        ({"block_size": 1}, "--block-size must be between"),
        ({"bcast_chunk": 1}, "--bcast-chunk must be between"),
        ({"shard_size": "1KiB"}, "--shard-size must be at least"),
        ({"concurrency": 99999}, "--concurrency must be between 1 and 4096"),
        ({"max_retries": 1000}, "--max-retries must be between 0 and 100"),
        ({"read_timeout": 1e300}, "--read-timeout must be at least 0.1 and at most 86400"),
        ({"read_timeout": float("nan")}, "--read-timeout"),
        ({"read_timeout": 10**400}, "option read_timeout cannot be a number of about 401 digits"),
        ({"connect_timeout": float("inf")}, "connect_timeout must be at least 0.1"),
        ({"max_bandwidth": 10**400}, "option max_bandwidth cannot be a number of about 401 digits"),
        ({"max_bandwidth": 1e300}, "--max-bandwidth must be at least"),
        ({"max_bandwidth": "9" * 400}, "is beyond the supported"),
        ({"verify": "bogus"}, "--verify must be one of disk, stream"),
        ({"verify": None}, "option verify cannot be None"),
        ({"lock": "never"}, "--lock must be one of wait, fail"),
        ({"lock": True}, "option lock cannot be True"),
        ({"lock_timeout": 0}, "--lock-timeout must be at least 0.1"),
        ({"lock_timeout": "5"}, "option lock_timeout cannot be '5'"),
    ],
)
def test_bad_options_raise_usage_error(options: dict[str, Any], words: str) -> None:
    with pytest.raises(UsageError) as caught:
        make_config("s", "d", options)
    assert words in caught.value.message
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(
    ("value", "mode"), [(True, "disk"), (False, ""), ("disk", "disk"), ("stream", "stream"), ("", "")]
)
def test_verify_takes_booleans_and_modes(value: object, mode: str) -> None:
    assert make_config("s", "d", {"verify": value}).verify == mode


@pytest.mark.parametrize(
    ("field", "value", "held"),
    [
        # Each kind of option reads the API's values its own way (api.coerce's table, _READS).
        ("download_workers", "auto", None),
        ("download_workers", 3, 3),
        ("download_workers", None, None),
        ("max_bandwidth", "8Kbps", 1000.0),
        ("max_bandwidth", 2048, 2048.0),
        ("max_bandwidth", None, None),
        ("read_timeout", 7, 7.0),
        ("progress", True, "auto"),
        ("progress", False, "none"),
        ("progress", "lines", "lines"),
        ("dry_run", True, True),
        ("overlap", False, False),
        ("json_path", None, None),
        ("source_rank", None, None),
        ("fanout_piece", "1MiB", MiB),
        ("include", ("a", "b"), ("a", "b")),
    ],
)
def test_each_kind_of_option_reads_its_values(field: str, value: object, held: object) -> None:
    assert coerce(field, value) == held
    assert type(coerce(field, value)) is type(held)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("download_workers", "8"),
        ("download_workers", 2.0),
        ("read_timeout", True),
        ("read_timeout", "5"),
        ("max_bandwidth", True),
        ("dry_run", 1),
        ("overlap", None),
        ("compare", None),
        ("progress", 1),
        ("fanout_piece", 1.5),
        ("include", None),
        ("include", {"a": 1}),
    ],
)
def test_values_no_kind_takes_are_refused(field: str, value: object) -> None:
    with pytest.raises(UsageError, match=f"option {field} cannot be|{field} must be a glob"):
        coerce(field, value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bcast_chunks": 1}, "unknown option(s) bcast_chunks (did you mean bcast_chunk?)"),
        (
            {"bcast-chunk": 1, "concurency": 2},
            "bcast-chunk (did you mean bcast_chunk?), concurency (did you mean concurrency?)",
        ),
        ({"frobnicate": 1}, "unknown option(s) frobnicate; valid: compare, concurrency,"),
    ],
)
def test_unknown_option_gets_the_command_lines_suggestion(options: dict[str, object], message: str) -> None:
    """The API proposes the closest option name as the command line does (options.did_you_mean), and lists
    the valid names only where it has no suggestion."""
    with pytest.raises(UsageError) as caught:
        make_config("s", "d", options)
    assert message in str(caught.value)
    assert ("valid:" in str(caught.value)) == ("frobnicate" in options)


def test_coerce_knows_only_the_fields_an_option_sets() -> None:
    with pytest.raises(UsageError, match="unknown option source"):
        coerce("source", "s")


def test_lock_options() -> None:
    assert make_config("s", "d", {"lock": "fail", "lock_timeout": 30}).lock_timeout == 30.0
    assert make_config("s", "d", {"lock_timeout": None}).lock_timeout is None


def test_a_json_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is a directory"):
        make_config("s", "d", {"json_path": str(tmp_path)})


def test_public_names_are_importable_lazily() -> None:
    assert azcp_cluster.AzcpError is AzcpError
    assert callable(azcp_cluster.stage) and azcp_cluster.Report.__name__ == "Report"
    with pytest.raises(AttributeError):
        azcp_cluster.no_such_name  # noqa: B018


def _program(args: list[str], out: Path) -> list[dict[str, Any]]:
    out.mkdir()
    proc = subprocess.run(
        [mpiexec_path(), "-n", "4", sys.executable, str(PROGRAM), args[0], args[1], str(out), *args[2:]],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=MPI_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(4)]
    assert [d["rank"] for d in lines] == [0, 1, 2, 3]
    return lines


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    root = tmp_path / "weights"
    (root / "shards").mkdir(parents=True)
    (root / "config.json").write_text('{"layers": 2}')
    for i in range(3):
        (root / "shards" / f"{i}.bin").write_bytes(bytes([i]) * (MiB + 17 * i))
    return root


@pytest.mark.parametrize("how", ["default-comm", "--explicit-comm"])
def test_stage_from_an_mpi4py_program(source: Path, tmp_path: Path, how: str) -> None:
    extra = [how] if how.startswith("--") else []
    lines = _program([str(source), str(tmp_path / "{rank}"), *extra], tmp_path / "out")
    assert all(d["ok"] and d["files"] == 4 and d["writers"] == 4 and d["after"] == 4 for d in lines), lines
    for rank in range(4):
        assert (tmp_path / str(rank) / "shards" / "2.bin").read_bytes() == bytes([2]) * (MiB + 34)


def test_a_failure_raises_the_same_typed_error_on_every_rank(source: Path, tmp_path: Path) -> None:
    (tmp_path / "2").write_text("a file where rank 2's DEST should be")
    lines = _program([str(source), str(tmp_path / "{rank}")], tmp_path / "out")
    assert all(not d["ok"] for d in lines), lines
    assert {(d["type"], d["code"]) for d in lines} == {("LocalFSError", 8)}
    assert len({d["line"] for d in lines}) == 1 and "rank 2" in lines[0]["line"]
    assert all(d["after"] == 4 for d in lines), "MPI still works after the failure"


def test_quiet_prints_no_progress_either_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import azcp_cluster.pipeline as pipeline
    from azcp_cluster.api import stage

    seen: list[str] = []
    monkeypatch.setattr(pipeline, "run", lambda cfg, comm, **kw: seen.append(cfg.progress))
    stage("/src", "/dest", comm=object(), quiet=True)
    stage("/src", "/dest", comm=object())
    stage("/src", "/dest", comm=object(), quiet=True, progress="lines")
    assert seen == ["none", "auto", "lines"]
