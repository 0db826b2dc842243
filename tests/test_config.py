"""Tests for size parsing and Config.validate (config.py), and the error tree (errors.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster import errors
from azcp_cluster.config import Config, GiB, KiB, MiB, TiB, format_bytes, parse_size
from azcp_cluster.errors import (
    EXIT_CODES,
    AzcpError,
    InternalError,
    ListError,
    LocalFSError,
    UsageError,
    exit_code_for,
)

# ---------------------------------------------------------------------------------------
# parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("123", 123),
        ("123b", 123),
        ("123B", 123),
        ("4k", 4 * KiB),
        ("4K", 4 * KiB),
        ("4KB", 4 * KiB),
        ("4kib", 4 * KiB),
        ("512M", 512 * MiB),
        ("64MiB", 64 * MiB),
        ("64mb", 64 * MiB),
        ("1GiB", GiB),
        ("1g", GiB),
        ("2TiB", 2 * TiB),
        ("1tb", TiB),
        (" 2 GiB ", 2 * GiB),
        ("1.5k", 1536),
        ("0.5GiB", 512 * MiB),
        ("1.25MiB", 1280 * KiB),
        ("007", 7),
    ],
)
def test_parse_size_examples(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "abc",
        "-1",
        "+1",
        "1e3",
        "1.",
        ".5",
        "1,5k",
        "1.3k",  # 1331.2 bytes
        "0.1",
        "10 XB",
        "10 PiB",
        "1 k b",
        "0x10",
        "1_000",
        "9" * 5000,  # more digits than int() converts
    ],
)
def test_parse_size_rejects(text: str) -> None:
    """Anything but a whole byte count is a UsageError (exit 2), never a traceback."""
    with pytest.raises(UsageError) as info:
        parse_size(text)
    assert exit_code_for(info.value) == 2


def test_parse_size_is_exact_beyond_float_precision() -> None:
    assert parse_size("9007199254740993") == 2**53 + 1
    assert parse_size("9" * 400) == int("9" * 400)
    assert parse_size("0.000000000931322574615478515625GiB") == 1


UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "KiB": KiB,
    "kb": KiB,
    "M": MiB,
    "mib": MiB,
    "MB": MiB,
    "G": GiB,
    "GiB": GiB,
    "gb": GiB,
    "t": TiB,
    "TiB": TiB,
    "TB": TiB,
}


@given(st.integers(0, 10**30), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]))
@settings(max_examples=300)
def test_parse_size_whole_numbers_are_exact(number: int, unit: str, space: str) -> None:
    assert parse_size(f"{number}{space}{unit}") == number * UNITS[unit]


@given(st.integers(0, 10**6), st.integers(0, 1023), st.sampled_from(["k", "M", "G", "T"]))
@settings(max_examples=200)
def test_parse_size_binary_fractions(whole: int, numerator: int, unit: str) -> None:
    # numerator/1024 always has an exact decimal expansion (at most 10 digits).
    fraction = f"{numerator / 1024:.10f}".rstrip("0").lstrip("0") or "."
    text = f"{whole}{fraction}0{unit}" if fraction == "." else f"{whole}{fraction}{unit}"
    factor = {"k": KiB, "M": MiB, "G": GiB, "T": TiB}[unit]
    assert parse_size(text) == whole * factor + numerator * factor // 1024


@given(st.text(max_size=30))
@settings(max_examples=300)
def test_parse_size_never_raises_anything_but_usage_error(text: str) -> None:
    try:
        value = parse_size(text)
    except UsageError:
        return
    assert isinstance(value, int)
    assert value >= 0


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(64 * MiB) == "64.00 MiB"
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(2 * TiB) == "2.00 TiB"


# ---------------------------------------------------------------------------------------
# Config.validate


def test_defaults_validate() -> None:
    cfg = Config(source="https://acct.blob.core.windows.net/data", dest="/tmp/x")
    assert cfg.validate() is cfg
    assert cfg.shard_size == GiB
    assert cfg.bcast_chunk == 64 * MiB


@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({"compare": "sha1"}, "--compare"),
        ({"compare": ""}, "--compare"),
        ({"concurrency": 0}, "--concurrency"),
        ({"concurrency": 4097}, "--concurrency"),
        ({"block_size": 0}, "--block-size"),
        ({"block_size": -1}, "--block-size"),
        ({"bcast_chunk": 0}, "--bcast-chunk"),
        ({"shard_size": 0}, "--shard-size"),
        ({"max_retries": -1}, "--max-retries"),
        ({"read_timeout": 0.0}, "timeouts"),
        ({"connect_timeout": -1.0}, "timeouts"),
        ({"source": ""}, "SOURCE"),
        ({"dest": ""}, "DEST"),
    ],
)
def test_validate_names_the_bad_option(changes: dict[str, Any], option: str) -> None:
    cfg = dataclasses.replace(Config(source="s", dest="d"), **changes)
    with pytest.raises(UsageError) as info:
        cfg.validate()
    assert option in info.value.message
    assert exit_code_for(info.value) == 2


@pytest.mark.parametrize(
    "changes",
    [
        {"compare": "none"},
        {"concurrency": 1},
        {"concurrency": 4096},
        {"max_retries": 0},
        {"block_size": 1, "bcast_chunk": 1, "shard_size": 1},
        {"read_timeout": 0.001, "connect_timeout": 0.001},
    ],
)
def test_validate_accepts_boundaries(changes: dict[str, Any]) -> None:
    dataclasses.replace(Config(source="s", dest="d"), **changes).validate()


# ---------------------------------------------------------------------------------------
# errors.py: one_line and exit codes

ALL_ERRORS = list(errors.ERROR_CLASSES.values())


def test_one_line_format() -> None:
    assert ListError("no such container").one_line() == "azcp-cluster: error [list]: no such container"
    assert LocalFSError("cannot write: no space left on device", path="d/f", rank=3).one_line() == (
        "azcp-cluster: error [local]: rank 3: 'd/f': cannot write: no space left on device"
    )
    assert UsageError("bad\n  option\twith   spaces").one_line() == (
        "azcp-cluster: error [arguments]: bad option with spaces"
    )


@given(
    cls=st.sampled_from(ALL_ERRORS),
    message=st.text(max_size=40),
    path=st.one_of(st.none(), st.text(max_size=40)),
    rank=st.one_of(st.none(), st.integers(0, 100_000)),
)
@settings(max_examples=400)
def test_one_line_is_a_single_line(cls: type[AzcpError], message: str, path: str | None, rank: int | None) -> None:
    line = cls(message, path=path, rank=rank).one_line()
    assert len(line.splitlines()) == 1
    assert "\n" not in line and "\r" not in line
    assert line.startswith(f"azcp-cluster: error [{cls.stage}]: ")
    if rank is not None:
        assert f"rank {rank}" in line
    if path is not None and path.isprintable():
        assert f"'{path}'" in line


def test_one_line_escapes_line_breaks_in_paths() -> None:
    line = ListError("bad name", path="evil\nname\u2028x").one_line()
    assert line == "azcp-cluster: error [list]: 'evil\\nname\\u2028x': bad name"


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (errors.InternalError, 1),
        (errors.UsageError, 2),
        (errors.TopologyError, 2),
        (errors.ListError, 3),
        (errors.DiffError, 4),
        (errors.DownloadError, 5),
        (errors.BroadcastError, 6),
        (errors.VerifyError, 7),
        (errors.LocalFSError, 8),
    ],
)
def test_exit_code_for_project_errors(cls: type[AzcpError], code: int) -> None:
    assert exit_code_for(cls("x")) == code
    assert code in EXIT_CODES


@pytest.mark.parametrize("exc", [ValueError("x"), KeyError("k"), OSError(5, "io"), RuntimeError(), KeyboardInterrupt()])
def test_exit_code_for_foreign_exceptions_is_internal(exc: BaseException) -> None:
    assert exit_code_for(exc) == InternalError.exit_code == 1


def test_error_table_is_complete() -> None:
    assert set(errors.ERROR_CLASSES) == {c.__name__ for c in ALL_ERRORS}
    assert all(issubclass(c, AzcpError) for c in ALL_ERRORS)
    assert {c.exit_code for c in ALL_ERRORS} <= set(EXIT_CODES)
    assert len({c.stage for c in ALL_ERRORS}) == len(ALL_ERRORS)  # each class names its own stage
    assert errors.EXIT_OK == 0 and 0 in EXIT_CODES
