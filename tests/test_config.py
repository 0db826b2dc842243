"""Tests for size parsing and Config.validate (config.py), the option ranges on the command
line (cli.py), the JSON report's writing (report.py), and the error tree (errors.py)."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.api import make_config
from azcp_cluster.core import errors
from azcp_cluster.core.config import (
    LOCK_MODES,
    MAX_BANDWIDTH_LIMIT,
    MAX_BCAST_CHUNK,
    MAX_BCAST_PIPELINE,
    MAX_BCAST_WRITERS,
    MAX_BLOCK_SIZE,
    MAX_CONCURRENCY,
    MAX_DOWNLOAD_WORKERS,
    MAX_LOCK_TIMEOUT,
    MAX_READ_TIMEOUT,
    MAX_RETRIES_LIMIT,
    MIN_BCAST_CHUNK,
    MIN_BLOCK_SIZE,
    MIN_SHARD_SIZE,
    VERIFY_MODES,
    Config,
    GiB,
    KiB,
    MiB,
    TiB,
    format_bytes,
    json_inside_dest,
    parse_rate,
    parse_size,
    shown,
)
from azcp_cluster.core.errors import (
    EXIT_CODES,
    AzcpError,
    InternalError,
    ListError,
    LocalFSError,
    UsageError,
    exit_code_for,
)
from azcp_cluster.options import BLOB, LOCAL, OPTIONS, config_from_args, normalise_verify
from azcp_cluster.run.report import Report

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
    assert cfg.bcast_chunk is None and cfg.chunk == 16 * MiB  # a chain's slot (--fanout auto)
    assert replace(cfg, fanout="ibcast").chunk == 64 * MiB and replace(cfg, bcast_chunk=MiB).chunk == MiB


@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({"compare": "sha1"}, "--compare"),
        ({"compare": ""}, "--compare"),
        ({"concurrency": 0}, "--concurrency"),
        ({"concurrency": MAX_CONCURRENCY + 1}, "--concurrency"),
        ({"concurrency": 10**5000}, "--concurrency"),  # more digits than str() shows
        ({"block_size": 0}, "--block-size"),
        ({"block_size": -1}, "--block-size"),
        ({"block_size": 1}, "--block-size"),
        ({"block_size": MIN_BLOCK_SIZE - 1}, "--block-size"),
        ({"block_size": MAX_BLOCK_SIZE + 1}, "--block-size"),
        ({"block_size": 10**400}, "--block-size"),
        ({"bcast_chunk": 0}, "--bcast-chunk"),
        ({"bcast_chunk": 1}, "--bcast-chunk"),
        ({"bcast_chunk": MIN_BCAST_CHUNK - 1}, "--bcast-chunk"),
        ({"bcast_chunk": MAX_BCAST_CHUNK + 1}, "--bcast-chunk"),
        ({"shard_size": 0}, "--shard-size"),
        ({"shard_size": MIN_SHARD_SIZE - 1}, "--shard-size"),
        ({"bcast_pipeline": 0}, "--bcast-pipeline"),
        ({"bcast_pipeline": MAX_BCAST_PIPELINE + 1}, "--bcast-pipeline"),
        ({"bcast_writers": 0}, "--bcast-writers"),
        ({"bcast_writers": MAX_BCAST_WRITERS + 1}, "--bcast-writers"),
        ({"max_retries": -1}, "--max-retries"),
        ({"max_retries": MAX_RETRIES_LIMIT + 1}, "--max-retries"),
        ({"read_timeout": 0.0}, "--read-timeout"),
        ({"read_timeout": -1.0}, "--read-timeout"),
        ({"read_timeout": MAX_READ_TIMEOUT + 1}, "--read-timeout"),
        ({"read_timeout": 1e300}, "--read-timeout"),
        ({"read_timeout": math.nan}, "--read-timeout"),
        ({"read_timeout": math.inf}, "--read-timeout"),
        ({"connect_timeout": -1.0}, "connect_timeout"),
        ({"connect_timeout": math.inf}, "connect_timeout"),
        ({"max_bandwidth": 0.0}, "--max-bandwidth"),
        ({"max_bandwidth": float(MAX_BANDWIDTH_LIMIT) * 2}, "--max-bandwidth"),
        ({"max_bandwidth": math.nan}, "--max-bandwidth"),
        ({"max_bandwidth": math.inf}, "--max-bandwidth"),
        ({"source_rank": -1}, "--source-rank"),
        ({"download_ranks": 0}, "--download-ranks"),
        ({"lock": "bogus"}, "--lock must be one of wait, fail"),
        ({"lock": ""}, "--lock"),
        ({"lock_timeout": 0.0}, "--lock-timeout"),
        ({"lock_timeout": -5.0}, "--lock-timeout"),
        ({"lock_timeout": MAX_LOCK_TIMEOUT + 1}, "--lock-timeout"),
        ({"lock_timeout": math.nan}, "--lock-timeout"),
        ({"verify": "bogus"}, "--verify must be one of disk, stream"),
        ({"verify": True}, "--verify"),  # the API converts booleans; Config holds the mode
        ({"json_path": ""}, "--json"),
        ({"source": ""}, "SOURCE"),
        ({"dest": ""}, "DEST"),
        ({"progress": "loud"}, "--progress must be one of auto, bar, lines, none, not 'loud'"),
        ({"auth": "password"}, "--auth must be one of auto, sas,"),
        ({"download_workers": 0}, "--download-workers must be auto or between 1 and"),
        ({"download_workers": MAX_DOWNLOAD_WORKERS + 1}, "--download-workers"),
        ({"source_readers": 0}, "--source-readers must be at least 1"),
        ({"source_readers": 2, "source_rank": 0}, "--source-rank names one reader"),
    ],
)
def test_validate_names_the_bad_option(changes: dict[str, Any], option: str) -> None:
    cfg = dataclasses.replace(Config(source="s", dest="d"), **changes)
    with pytest.raises(UsageError) as info:
        cfg.validate()
    assert option in info.value.message
    assert exit_code_for(info.value) == 2
    assert "\n" not in info.value.message and len(info.value.message) < 200  # one short line


def test_validate_reports_the_first_broken_rule_in_its_order() -> None:
    # Config.validate's order (one check per concern): with every concern broken at once, each
    # fixed in turn lets the next one be named. The message names one option, never a later one.
    broken: list[tuple[dict[str, Any], str]] = [
        ({"progress": "loud"}, "--progress"),
        ({"fanout_piece": 1}, "--fanout-piece"),
        ({"auth": "password"}, "--auth"),
        ({"block_size": 1}, "--block-size"),
        ({"concurrency": 0}, "--concurrency"),
        ({"source_readers": 0}, "--source-readers"),
        ({"download_ranks": 0}, "--download-ranks"),
        ({"peer_timeout": 0.5}, "--peer-timeout"),
        ({"read_timeout": 0.0}, "--read-timeout"),
        ({"verify": "bogus"}, "--verify"),
        ({"lock": "never"}, "--lock"),
        ({"json_path": ""}, "--json"),
        ({"source": ""}, "SOURCE"),
    ]
    for first in range(len(broken)):
        changes = {k: v for fields, _ in broken[first:] for k, v in fields.items()}
        with pytest.raises(UsageError) as info:
            dataclasses.replace(Config(source="s", dest="d"), **changes).validate()
        assert info.value.message.startswith(broken[first][1]), (first, info.value.message)


@pytest.mark.parametrize(
    "changes",
    [
        {"compare": "none"},
        {"concurrency": 1},
        {"concurrency": 4096},
        {"max_retries": 0},
        {"max_retries": 100},
        {"block_size": 64 * KiB, "bcast_chunk": 64 * KiB, "shard_size": 64 * KiB},
        {"block_size": GiB, "bcast_chunk": 16 * GiB, "shard_size": 10**400},
        {"bcast_pipeline": 1, "bcast_writers": 1},
        {"bcast_pipeline": 256, "bcast_writers": 64},
        {"read_timeout": 0.1, "connect_timeout": 0.1},
        {"read_timeout": 86400.0, "connect_timeout": 86400.0},
        {"max_bandwidth": 1024.0},  # 8 Kb/s, the least
        {"max_bandwidth": 1e15},
        {"lock": "fail", "lock_timeout": 0.1},
        {"lock": "wait", "lock_timeout": 7 * 86400.0},
        {"verify": "disk"},
        {"verify": "stream"},
        {"verify": ""},
        {"source_rank": 0, "download_ranks": 1},
    ],
)
def test_validate_accepts_boundaries(changes: dict[str, Any]) -> None:
    dataclasses.replace(Config(source="s", dest="d"), **changes).validate()


def test_limits_are_the_documented_ones() -> None:
    assert MIN_BLOCK_SIZE == MIN_BCAST_CHUNK == MIN_SHARD_SIZE == 64 * KiB
    assert (MAX_BLOCK_SIZE, MAX_BCAST_CHUNK) == (2**30, 16 * 2**30)
    assert (MAX_CONCURRENCY, MAX_BCAST_PIPELINE, MAX_BCAST_WRITERS, MAX_RETRIES_LIMIT) == (4096, 256, 64, 100)
    assert (MAX_READ_TIMEOUT, MAX_LOCK_TIMEOUT, MAX_BANDWIDTH_LIMIT) == (86400, 7 * 86400, 10**15)
    assert VERIFY_MODES == ("disk", "stream") and LOCK_MODES == ("wait", "fail")
    defaults = Config(source="s", dest="d")
    assert (defaults.verify, defaults.lock, defaults.lock_timeout) == ("", "wait", None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("abc", "'abc'"),
        (12, "12"),
        ("9" * 400, "'" + "9" * 29 + "... (402 characters)"),
        pytest.param(10**400, "a number of about 401 digits", id="401-digits"),
        pytest.param(10**5000, "a number of about 5001 digits", id="5001-digits"),
    ],
)
def test_shown_keeps_messages_short(value: object, expected: str) -> None:
    assert shown(value) == expected


# ---------------------------------------------------------------------------------------
# parse_rate


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1.0),
        ("1b", 0.125),
        ("25Gbps", 25e9 / 8),
        ("3GiB/s", 3.0 * GiB),
        ("3GB/s", 3.0 * GiB),
        ("909TB/s", 909.0 * 2**40),
        ("1000000000000000", 1e15),
    ],
)
def test_parse_rate_examples(text: str, expected: float) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "9" * 400,  # float(Fraction) overflowed: an OverflowError traceback
        "9" * 5000,  # more digits than int() converts
        "910TB/s",  # bytes are binary: 910 x 2**40 > 10**15
        "8001Tbps",
        "0." + "0" * 400 + "1",  # positive, but 0.0 as a float
        "0",
        "fast",
    ],
)
def test_parse_rate_refuses_in_one_short_line(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_rate(text)
    assert len(info.value.message) < 200


@given(st.text(max_size=30))
@settings(max_examples=200)
def test_parse_rate_never_raises_anything_but_usage_error(text: str) -> None:
    try:
        rate = parse_rate(text)
    except UsageError:
        return
    assert 0 < rate <= MAX_BANDWIDTH_LIMIT


# ---------------------------------------------------------------------------------------
# json_inside_dest


@pytest.mark.parametrize(
    ("json_real", "dest_real", "inside"),
    [
        ("/data/x/report.json", "/data/x", True),
        ("/data/x/sub/report.json", "/data/x", True),
        ("/data/x", "/data/x", True),
        ("/data/x/report.json", "/data/x/", True),
        ("/anything.json", "/", True),
        ("/data/xy/report.json", "/data/x", False),
        ("/data/x.json", "/data/x", False),
        ("/data/report.json", "/data/x", False),
        ("/tmp/report.json", "/data/x", False),
    ],
)
def test_json_inside_dest(json_real: str, dest_real: str, inside: bool) -> None:
    assert json_inside_dest(json_real, dest_real) is inside


segment = st.text(st.sampled_from("abxy.-"), min_size=1, max_size=4).filter(lambda s: s not in (".", ".."))


@given(st.lists(segment, min_size=1, max_size=4), st.lists(segment, max_size=3), st.lists(segment, min_size=1))
@settings(max_examples=200)
def test_json_inside_dest_is_path_prefix_by_segments(dest: list[str], below: list[str], other: list[str]) -> None:
    dest_real = "/" + "/".join(dest)
    assert json_inside_dest("/" + "/".join([*dest, *below]), dest_real)
    sibling = "/" + "/".join([*dest[:-1], dest[-1] + "z", *below])  # shares a prefix, not a segment
    assert not json_inside_dest(sibling, dest_real)
    outside = "/" + "/".join(other)
    assert json_inside_dest(outside, dest_real) == (other[: len(dest)] == dest)


# ---------------------------------------------------------------------------------------
# The command line: ranges, --verify MODE, --lock, --json


ARGS = ["http://127.0.0.1:1/acct/c", "/tmp/x"]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--block-size", "1"], "--block-size must be between 64.00 KiB and 1.00 GiB"),
        (["--block-size", "2GiB"], "--block-size must be between"),
        (["--bcast-chunk", "1"], "--bcast-chunk must be between"),
        (["--bcast-chunk", "17GiB"], "--bcast-chunk must be between"),
        (["--shard-size", "1"], "--shard-size must be at least 64.00 KiB"),
        (["--shard-size", "9" * 5000], "size '999"),
        (["--max-bandwidth", "9" * 400], "is beyond the supported"),
        (["--read-timeout", "1e300"], "--read-timeout must be at least 0.1 and at most 86400 seconds"),
        (["--read-timeout", "nan"], "--read-timeout"),
        (["--read-timeout", "inf"], "--read-timeout"),
        (["--read-timeout", "9" * 5000], "--read-timeout"),
        (["--concurrency", "99999"], "--concurrency must be between 1 and 4096"),
        (["--concurrency", "9" * 5000], "argument --concurrency: '999"),
        (["--concurrency", "many"], "argument --concurrency: invalid whole number 'many'"),
        (["--max-retries", "-1"], "--max-retries must be between 0 and 100"),
        (["--max-retries", "1000"], "--max-retries must be between 0 and 100"),
        (["--bcast-writers", "0"], "--bcast-writers must be between 1 and 64"),
        (["--bcast-pipeline", "0"], "--bcast-pipeline must be between 1 and 256"),
        (["--download-ranks", "0"], "--download-ranks must be at least 1"),
        (["--source-rank", "-1"], "--source-rank must be zero or more"),
        (["--lock", "bogus"], "argument --lock: invalid choice"),
        (["--lock-timeout", "0"], "--lock-timeout must be at least 0.1 and at most 604800 seconds"),
        (["--lock-timeout", "-5"], "--lock-timeout"),
        (["--lock-timeout", "1e9"], "--lock-timeout"),
        (["--verify=bogus"], "argument --verify: invalid choice: 'bogus'"),
        (["--json", ""], "--json PATH is empty"),
    ],
)
def test_cli_refuses_out_of_range_values_in_one_short_line(extra: list[str], words: str) -> None:
    with pytest.raises(UsageError) as info:
        config_from_args([*ARGS, *extra])
    line = info.value.one_line()
    assert words in line, line
    assert len(line) < 300 and "\n" not in line


# Every control character (C0 and DEL), first, in the middle and last, in SOURCE (a URL with a
# SAS, whose parsing would drop a tab or a line break, and a path) and in DEST.
CONTROLS = [chr(c) for c in range(0x20)] + ["\x7f"]
URL = "https://acct.blob.core.windows.net/container/p?sv=1&sig=SECRET"


@pytest.mark.parametrize("char", CONTROLS, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize("which", ["SOURCE-url", "SOURCE-path", "DEST"])
@pytest.mark.parametrize("at", [0, 7, -1], ids=["first", "middle", "last"])
def test_a_control_character_in_source_or_dest_is_refused_by_its_place(char: str, which: str, at: int) -> None:
    good = {"SOURCE-url": URL, "SOURCE-path": "/data/ckpt", "DEST": "/mnt/nvme/copy"}[which]
    index = len(good) if at == -1 else at
    bad = good[:index] + char + good[index:]
    source, dest = (bad, "/mnt/nvme/copy") if which != "DEST" else ("/data/ckpt", bad)
    name = which.split("-")[0]
    want = (
        f"{name} has a control character (U+{ord(char):04X}, {char!r}) at character {index + 1} of {len(bad)}; "
        "remove it (a stray tab or line break in a job script?)"
    )
    for make in (lambda: Config(source=source, dest=dest).validate(), lambda: make_config(source, dest, {})):
        with pytest.raises(UsageError) as info:
            make()
        assert info.value.message == want
        assert info.value.exit_code == 2
        assert "SECRET" not in info.value.one_line() and "\n" not in info.value.one_line()
    if "\x00" not in bad:  # argv cannot hold a NUL
        with pytest.raises(UsageError, match="has a control character"):
            config_from_args([source, dest])


@pytest.mark.parametrize("text", [" ", "ü", "\u00a0", "\x80", "\x85", "\x9f", "\u2028", "~"])
def test_printable_and_other_characters_in_source_and_dest_are_left_alone(text: str) -> None:
    # Only C0 and DEL are refused: a space, a non-ASCII name (and the C1 range, which a
    # Latin-1 file name may hold) stay the user's business.
    cfg = Config(source=f"/data/a{text}b", dest=f"/mnt/c{text}d").validate()
    assert (cfg.source, cfg.dest) == (f"/data/a{text}b", f"/mnt/c{text}d")


# Each option for one kind of SOURCE only, with a value other than its default: on the
# command line (None: the API's only) and as the API's keyword.
FOR_ONE_KIND: dict[str, tuple[str, list[str] | None, Any]] = {
    "concurrency": (BLOB, ["--concurrency", "8"], 8),
    "block_size": (BLOB, ["--block-size", "1MiB"], "1MiB"),
    "max_bandwidth": (BLOB, ["--max-bandwidth", "1Gbps"], "1Gbps"),
    "download_ranks": (BLOB, ["--download-ranks", "1"], 1),
    "auth": (BLOB, ["--auth", "key"], "key"),
    "download_workers": (BLOB, ["--download-workers", "2"], 2),
    "max_retries": (BLOB, ["--max-retries", "0"], 0),
    "read_timeout": (BLOB, ["--read-timeout", "5"], 5),
    "connect_timeout": (BLOB, None, 5),
    "overlap": (BLOB, ["--no-overlap"], False),
    "source_rank": (LOCAL, ["--source-rank", "0"], 0),
    "source_readers": (LOCAL, ["--source-readers", "2"], 2),
}
KIND_SOURCE = {BLOB: "https://acct.blob.core.windows.net/c/p", LOCAL: "/lustre/ckpt"}


def test_the_option_table_names_the_options_for_one_kind_of_source() -> None:
    assert {o.field: o.source for o in OPTIONS if o.source} == {f: kind for f, (kind, _, _) in FOR_ONE_KIND.items()}


@pytest.mark.parametrize("field", list(FOR_ONE_KIND))
def test_an_option_for_the_other_kind_of_source_is_refused_naming_it(field: str) -> None:
    kind, argv, value = FOR_ONE_KIND[field]
    other = LOCAL if kind == BLOB else BLOB
    flag = argv[0] if argv else field
    want = f"{flag} is for a {kind} SOURCE only: "
    builders = [lambda source: make_config(source, "/mnt/nvme/d", {field: value})]
    if argv:
        builders.append(lambda source: config_from_args([source, "/mnt/nvme/d", *argv]))
    for build in builders:
        with pytest.raises(UsageError) as info:
            build(KIND_SOURCE[other])
        assert info.value.message.startswith(want) and info.value.message.endswith("; leave it out")
        assert exit_code_for(info.value) == 2
        assert getattr(build(KIND_SOURCE[kind]), field) != getattr(Config(source="s", dest="d"), field)


def test_every_option_for_the_other_kind_is_named_in_one_line_and_defaults_pass() -> None:
    with pytest.raises(UsageError) as info:
        config_from_args(["/lustre/ckpt", "/d", "--max-bandwidth", "1Gbps", "--no-overlap", "--concurrency", "4"])
    assert info.value.message == (
        "--concurrency, --max-bandwidth and --no-overlap are for a blob URL SOURCE only: a local SOURCE is read "
        "by its reader ranks, and nothing is downloaded; leave them out"
    )
    with pytest.raises(UsageError, match=r"^--source-rank is for a local SOURCE only: a blob URL is downloaded by"):
        config_from_args([KIND_SOURCE[BLOB], "/d", "--source-rank", "0"])
    # Set to its default, an option changes nothing, whatever the SOURCE (an API caller may pass all).
    assert config_from_args(["/lustre/ckpt", "/d", "--concurrency", "64", "--source-readers", "1"]).concurrency == 64
    assert make_config(KIND_SOURCE[BLOB], "/d", {"source_rank": None, "source_readers": 1}).source_readers == 1


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # The misspelled option before SOURCE: argparse alone took 64MiB for SOURCE and blamed DEST.
        (["--bcast-chunks", "64MiB", *ARGS], "unrecognized option --bcast-chunks (did you mean --bcast-chunk?)"),
        ([*ARGS, "--bcast-chunks=64MiB"], "unrecognized option --bcast-chunks (did you mean --bcast-chunk?)"),
        ([*ARGS, "--no-overlaps"], "unrecognized option --no-overlaps (did you mean --no-overlap?)"),
        ([*ARGS, "--jsonpath", "r.json"], "unrecognized option --jsonpath (did you mean --json?)"),
        ([*ARGS, "--frobnicate"], "unrecognized option --frobnicate (see --help)"),
        ([*ARGS, "--bcast", "1"], "unrecognized option --bcast ("),  # no abbreviations, ambiguous or not
    ],
)
def test_cli_names_a_misspelled_option_and_its_closest_match(argv: list[str], words: str) -> None:
    with pytest.raises(UsageError) as info:
        config_from_args(argv)
    line = info.value.one_line()
    assert line == f"azcp-cluster: error [arguments]: {words}" or words in line, line
    assert ARGS[1] not in line  # DEST is not the culprit


def test_cli_refuses_abbreviations_and_leaves_what_follows_double_dash() -> None:
    """No abbreviations: ``--del`` in a job script would quietly have meant --delete."""
    with pytest.raises(UsageError, match=r"unrecognized option --bcast-chu \(did you mean --bcast-chunk\?\)"):
        config_from_args(["--bcast-chu", "1MiB", *ARGS])
    with pytest.raises(UsageError, match=r"unrecognized option --del \(did you mean --delete\?\)"):
        config_from_args([*ARGS, "--del"])
    with pytest.raises(UsageError, match="unrecognized arguments: --bcast-chunks"):
        config_from_args([*ARGS, "--", "--bcast-chunks"])  # a third positional, not an option


def test_cli_refuses_a_json_path_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is a directory"):
        config_from_args([*ARGS, "--json", str(tmp_path)])
    assert config_from_args([*ARGS, "--json", str(tmp_path / "r.json")]).json_path == str(tmp_path / "r.json")
    assert list(tmp_path.iterdir()) == []  # checked, nothing written


@pytest.mark.parametrize(
    ("argv", "mode", "source"),
    [
        ([*ARGS], "", ARGS[0]),
        (["--verify", *ARGS], "disk", ARGS[0]),  # a bare --verify before SOURCE keeps SOURCE
        ([*ARGS, "--verify"], "disk", ARGS[0]),
        (["--verify", "disk", *ARGS], "disk", ARGS[0]),
        (["--verify", "stream", *ARGS], "stream", ARGS[0]),
        ([*ARGS, "--verify", "stream"], "stream", ARGS[0]),
        (["--verify=stream", *ARGS], "stream", ARGS[0]),
        (["--verify=disk", *ARGS], "disk", ARGS[0]),
        (["--verify", "--no-progress", *ARGS], "disk", ARGS[0]),
    ],
)
def test_cli_verify_modes(argv: list[str], mode: str, source: str) -> None:
    cfg = config_from_args(argv)
    assert (cfg.verify, cfg.source, cfg.dest) == (mode, source, ARGS[1])


def test_normalise_verify_leaves_everything_after_a_double_dash() -> None:
    assert normalise_verify(["--verify", "--", "--verify"]) == ["--verify=disk", "--", "--verify"]
    assert normalise_verify(["--version"]) == ["--version"]


def test_cli_lock_options() -> None:
    cfg = config_from_args(ARGS)
    assert (cfg.lock, cfg.lock_timeout) == ("wait", None)
    cfg = config_from_args([*ARGS, "--lock", "fail"])
    assert cfg.lock == "fail"
    cfg = config_from_args([*ARGS, "--lock", "wait", "--lock-timeout", "90.5"])
    assert (cfg.lock, cfg.lock_timeout) == ("wait", 90.5)


# ---------------------------------------------------------------------------------------
# Report.write_json: atomic, never through a symlink, nothing left behind


def test_write_json_writes_atomically(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.write_text("old")
    Report(files=3).write_json(str(target))
    assert json.loads(target.read_text())["files"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_write_json_onto_a_directory_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.mkdir()
    with pytest.raises(OSError):
        Report().write_json(str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"] and list(target.iterdir()) == []


def test_write_json_does_not_follow_a_symlink_at_the_temporary_name(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("precious")
    planted = tmp_path / f"r.json.tmp{os.getpid()}"
    planted.symlink_to(elsewhere)
    with pytest.raises(OSError):
        Report().write_json(str(target))
    assert elsewhere.read_text() == "precious"
    assert planted.is_symlink() and not target.exists()  # someone else's link: left as it was


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_json_never_replaces_a_link_or_a_special_file(tmp_path: Path, kind: str) -> None:
    # As root, --json /dev/null would otherwise replace the system's device node with a file.
    from azcp_cluster.run.report import check_json_path

    target = tmp_path / "r.json"
    if kind == "symlink":
        (tmp_path / "elsewhere").write_text("precious")
        target.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(target)
    with pytest.raises(UsageError, match="not a regular file"):
        check_json_path(str(target))
    with pytest.raises(OSError):
        Report().write_json(str(target))  # put there after the check: still not replaced
    assert target.is_symlink() if kind == "symlink" else target.is_fifo()
    left = ["elsewhere", "r.json"] if kind == "symlink" else ["r.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == left  # and no temporary file beside it
    check_json_path(str(tmp_path / "new.json"))  # nothing there, or a regular file: fine


def test_write_json_removes_its_temporary_file_when_the_rename_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(src: str, dst: str) -> None:
        raise OSError(errno.EXDEV, "refused")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        Report().write_json(str(tmp_path / "r.json"))
    assert list(tmp_path.iterdir()) == []


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
        (errors.SigintError, 130),
        (errors.SigtermError, 143),
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
    # Each class names its own stage, but the signals: SIGINT and SIGTERM are both [interrupted].
    stopped = [c for c in ALL_ERRORS if issubclass(c, errors.Interrupted)]
    assert {c.stage for c in stopped} == {"interrupted"} and {c.exit_code for c in stopped} == {130, 143}
    # ReportPathError is an [arguments] error that tells the CLI not to write the report.
    others = [c for c in ALL_ERRORS if c not in stopped and c is not errors.ReportPathError]
    assert len({c.stage for c in others}) == len(others)
    assert errors.ReportPathError.stage == errors.UsageError.stage
    assert errors.EXIT_OK == 0 and 0 in EXIT_CODES
