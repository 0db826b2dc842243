"""The command line's options: argv into one validated :class:`Config` (argparse, units, ranges).

The entry point (signals, MPI's start and end, errors into exit codes) is :mod:`azcp_cluster.cli`.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import NoReturn

from azcp_cluster import __version__
from azcp_cluster.config import (
    AUTH_METHODS,
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
    MIN_BANDWIDTH,
    MIN_BCAST_CHUNK,
    MIN_BLOCK_SIZE,
    MIN_SHARD_SIZE,
    MIN_TIMEOUT,
    PROGRESS_MODES,
    VERIFY_MODES,
    Config,
    parse_rate,
    parse_size,
    shown,
)
from azcp_cluster.errors import EXIT_CODES, UsageError
from azcp_cluster.report import check_json_path

EPILOG = "exit codes:\n" + "\n".join(f"  {code}  {text}" for code, text in EXIT_CODES.items())

DESCRIPTION = """\
Stage one dataset onto every node: SOURCE is listed once, each byte is read from it once
(Azure: every downloading rank fetches only its share), then an MPI broadcast between
nodes fans every file out to DEST on every node. Launch it on every node, e.g.
`srun --ntasks-per-node=1 azcp-cluster ...` or `mpiexec -n 4 azcp-cluster ...`; with
several ranks per node, one rank per node writes DEST and the others help download.

SOURCE  https://ACCOUNT.blob.core.windows.net/CONTAINER[/PREFIX][?SAS]  or the path style
        http(s)://HOST:PORT/ACCOUNT/CONTAINER[/PREFIX][?SAS] (emulator, custom endpoints).
        PREFIX names a virtual directory (.../ckpt copies ckpt/**, never ckpt-other/);
        if a blob named exactly PREFIX exists, that one blob is copied.
        Or a local path (a file or a directory tree, e.g. on NFS, Lustre or blobfuse):
        one rank reads it (--source-rank) and the others receive it over MPI.
DEST    a directory, created if missing; {rank} and {host} are expanded per rank.

Credentials, first match wins: SAS in the URL, AZURE_STORAGE_CONNECTION_STRING,
AZURE_STORAGE_ACCOUNT + AZURE_STORAGE_KEY, AZURE_STORAGE_SAS_TOKEN, then (https only)
workload identity (AZURE_CLIENT_ID + AZURE_TENANT_ID + AZURE_FEDERATED_TOKEN_FILE), managed
identity (IDENTITY_ENDPOINT or MSI_ENDPOINT set), the Azure CLI (az on PATH and logged in),
anonymous. --auth METHOD (or AZCP_AUTH) forces one; on a VM, --auth managed-identity.
Sizes read 64MiB, 1GiB, 512M (binary units) or plain bytes.
"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises our UsageError instead of printing from every rank and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


def _units(n: int) -> str:
    """A size limit as the options are written: ``64KiB``, ``16GiB``."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _seconds(text: str) -> float:
    """A number of seconds; its range (nan and inf included) is Config.validate's to check."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {shown(text)}") from None


# An integer option takes at most this many digits: int() would refuse more than 4300, and a
# message would repeat them all; any range Config.validate accepts is far shorter.
_INT_DIGITS = 20


def _integer(text: str) -> int:
    """A whole number (its range is Config.validate's to check), refused in one short line otherwise."""
    digits = text.strip().lstrip("+-")
    if not (digits.isascii() and digits.isdigit()):
        raise argparse.ArgumentTypeError(f"invalid whole number {shown(text)}")
    if len(digits.lstrip("0")) > _INT_DIGITS:
        raise argparse.ArgumentTypeError(f"{shown(text)} is far beyond the supported range")
    return int(text)


def _workers(text: str) -> int | None:
    """``auto`` (None) or a whole number."""
    return None if text.strip().lower() == "auto" else _integer(text)


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the docs test to list every option)."""
    p = _Parser(
        prog="azcp-cluster",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source", metavar="SOURCE", help="blob container URL (optionally with a prefix and a SAS), or a local path"
    )
    p.add_argument("dest", metavar="DEST", help="destination directory on every node ({rank}, {host} expanded)")
    p.add_argument("--version", action="version", version=f"azcp-cluster {__version__}")
    p.add_argument(
        "--compare",
        choices=("none", "size", "etag", "md5"),
        default="size",
        help="when a file in DEST counts as already there: 'size' (same size; a blob replaced by one of the "
        "same size is NOT recopied), 'etag' (same size and the ETag recorded in DEST's manifest), 'md5' "
        "(hash the local file, compare with the blob's Content-MD5 or the manifest's), 'none' (copy all); "
        "default size",
    )
    p.add_argument(
        "--concurrency",
        type=_integer,
        default=64,
        help=f"ranged GETs in flight per rank, 1 to {MAX_CONCURRENCY} (default 64)",
    )
    p.add_argument(
        "--block-size",
        type=_size,
        default="16MiB",
        help=f"bytes per ranged GET, {_units(MIN_BLOCK_SIZE)} to {_units(MAX_BLOCK_SIZE)} (default 16MiB)",
    )
    p.add_argument(
        "--bcast-chunk",
        type=_size,
        default="64MiB",
        help=f"bytes per broadcast slot, {_units(MIN_BCAST_CHUNK)} to {_units(MAX_BCAST_CHUNK)}; split into MPI "
        "calls of at most 1GiB (default 64MiB)",
    )
    p.add_argument(
        "--bcast-pipeline",
        type=_integer,
        default=4,
        help=f"broadcasts in flight, 1 to {MAX_BCAST_PIPELINE}; memory per rank is pipeline x chunk "
        "(default 4 x 64MiB = 256MiB)",
    )
    p.add_argument(
        "--bcast-writers",
        type=_integer,
        default=2,
        help=f"threads writing received chunks to disk per rank, 1 to {MAX_BCAST_WRITERS} (default 2)",
    )
    p.add_argument(
        "--no-bcast-direct",
        action="store_true",
        help="write received chunks, and read back the owners' downloads, through the page cache instead of O_DIRECT",
    )
    p.add_argument(
        "--shard-size",
        type=_size,
        default="1GiB",
        help=f"files larger than this are split into byte ranges fetched by several ranks; at least "
        f"{_units(MIN_SHARD_SIZE)} (default 1GiB)",
    )
    p.add_argument(
        "--source-rank",
        type=_integer,
        metavar="R",
        help="local SOURCE: the rank that reads it (default: the lowest rank that can see it); no other rank opens it",
    )
    p.add_argument(
        "--source-readers",
        type=_integer,
        default=1,
        metavar="K",
        help="local SOURCE on a shared filesystem (Lustre, NFS with several servers): K ranks on different "
        "nodes read disjoint, balanced parts of it (default 1)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="download everything, then fan it out (default: each part goes out as soon as it lands)",
    )
    p.add_argument(
        "--no-resume",
        action="store_true",
        help="copy every missing file whole, ignoring (and removing) the block journal a stopped run left "
        "(default: keep the blocks it recorded and move only the rest)",
    )
    p.add_argument(
        "--download-ranks",
        type=_integer,
        metavar="K",
        help="only K ranks download from Azure, spread over the nodes (default: every rank); fewer clients "
        "for a throttled account",
    )
    p.add_argument(
        "--download-workers",
        type=_workers,
        default=None,
        metavar="N|auto",
        help="processes under each downloading rank that make its ranged GETs, so that TLS runs on every "
        f"core of a node (1 to {MAX_DOWNLOAD_WORKERS}; 1: in the rank itself); auto (the default): the rank "
        "downloads itself, measures its rate and the idle CPUs, and hands the rest of its share to workers "
        "(at most 8) only when they are predicted to shorten it",
    )
    p.add_argument(
        "--max-bandwidth",
        type=_rate,
        metavar="RATE",
        help="cap the cluster's aggregate download, split over the downloading ranks: 25Gbps, 800Mb/s "
        "(bits), 3GiB/s, 500MB/s (bytes) or bytes per second; stays under a storage account's egress "
        f"limit instead of meeting its 503s; at least {MIN_BANDWIDTH} and at most {MAX_BANDWIDTH_LIMIT:.0e} bytes per "
        "second, i.e. 8000Tbps (default: no cap)",
    )
    p.add_argument(
        "--max-retries",
        type=_integer,
        default=5,
        help=f"retries per request before giving up, 0 to {MAX_RETRIES_LIMIT} (default 5)",
    )
    p.add_argument(
        "--read-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="a request whose response sends nothing for this long is abandoned and retried; at least "
        f"{MIN_TIMEOUT:g}, at most {MAX_READ_TIMEOUT:.0f} (default 60)",
    )
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="copy only paths (below the prefix) matching GLOB; repeatable; '*' matches across '/'",
    )
    p.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="skip paths matching GLOB; repeatable"
    )
    p.add_argument(
        "--verify",
        nargs="?",
        const="disk",
        default="",
        choices=VERIFY_MODES,
        metavar="MODE",
        help="MD5 of every file, compared across ranks and with the blob's Content-MD5; a mismatch exits 7. "
        "MODE 'disk' (a bare --verify): every copy is read back from disk after its fsync and hashed; "
        "'stream': hashed as the bytes stream through each rank (skipped files are read from disk)",
    )
    p.add_argument(
        "--lock",
        choices=LOCK_MODES,
        default="wait",
        help="another run on the same DEST: 'wait' for it to finish (see --lock-timeout) or 'fail' at once; "
        "exit 9 if it is still there (default wait)",
    )
    p.add_argument(
        "--lock-timeout",
        type=_seconds,
        metavar="SECONDS",
        help=f"how long --lock wait waits for another run on the same DEST before exiting 9; at least "
        f"{MIN_TIMEOUT:g}, at most {MAX_LOCK_TIMEOUT:.0f} (7 days) (default: no limit)",
    )
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="a SOURCE (prefix, directory, --include/--exclude) that yields no file is a finished, empty copy "
        "(exit 0 with a warning); default: exit 3 naming it, as a typo in a job script should",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list, compare and print the plan (files and bytes per rank); write nothing",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        dest="json_path",
        help="write the report as JSON to PATH (rank 0); not a directory, not inside DEST",
    )
    p.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="rank 0's progress on stderr: 'bar' (one redrawn line), 'lines' (a status line each 5%% or "
        "10 s, for logs), 'none'; default auto: the bar on a terminal, lines otherwise (mpiexec, srun, a log)",
    )
    p.add_argument("--no-progress", action="store_true", help="the same as --progress none")
    p.add_argument(
        "--auth",
        choices=AUTH_METHODS,
        default="auto",
        metavar="METHOD",
        help="force one credential: " + ", ".join(AUTH_METHODS[1:]) + "; default auto (first match wins, or AZCP_AUTH)",
    )
    return p


def config_from_args(argv: Sequence[str] | None) -> Config:
    """Parse the command line into a validated :class:`Config`."""
    parser = build_parser()
    argv = normalise_verify(sys.argv[1:] if argv is None else argv)
    check_option_names(argv, parser)
    args = parser.parse_args(argv)
    cfg = Config(
        source=args.source,
        dest=args.dest,
        compare=args.compare,
        concurrency=args.concurrency,
        block_size=args.block_size,
        bcast_chunk=args.bcast_chunk,
        bcast_pipeline=args.bcast_pipeline,
        bcast_writers=args.bcast_writers,
        bcast_direct=not args.no_bcast_direct,
        shard_size=args.shard_size,
        max_retries=args.max_retries,
        read_timeout=args.read_timeout,
        include=tuple(args.include),
        exclude=tuple(args.exclude),
        dry_run=args.dry_run,
        verify=args.verify,
        json_path=args.json_path,
        progress="none" if args.no_progress else args.progress,
        auth=args.auth,
        source_rank=args.source_rank,
        source_readers=args.source_readers,
        overlap=not args.no_overlap,
        resume=not args.no_resume,
        download_ranks=args.download_ranks,
        download_workers=args.download_workers,
        max_bandwidth=args.max_bandwidth,
        lock=args.lock,
        lock_timeout=args.lock_timeout,
        allow_empty=args.allow_empty,
    ).validate()
    check_json_path(cfg.json_path)
    return cfg


def check_option_names(argv: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """Refuse an option name the parser does not know, naming it and the closest known one.

    argparse alone would take the misspelled option's value for SOURCE and report the real
    DEST as the unrecognized argument (``--bcast-chunks 64MiB URL DEST``). A name that starts
    a known option (an abbreviation, ambiguous or not) is left to argparse; nothing after
    ``--`` is an option.
    """
    known = sorted({name for action in parser._actions for name in action.option_strings if name.startswith("--")})
    for token in argv:
        if token == "--":
            return
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        if name in known or any(option.startswith(name) for option in known):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see --help"
        label = name if name.isprintable() and len(name) <= 64 else shown(name)
        raise UsageError(f"unrecognized option {label} ({hint})")


def normalise_verify(argv: Sequence[str]) -> list[str]:
    """``--verify`` not followed by a mode becomes ``--verify=disk``.

    The option takes an optional MODE, and argparse would otherwise take the next word
    for it: ``--verify SRC DEST`` must keep SRC. An abbreviation (``--verif``) counts as
    the option; nothing after ``--`` is touched.
    """
    out = list(argv)
    for i, token in enumerate(out):
        if token == "--":
            break
        if len(token) >= len("--veri") and "--verify".startswith(token):
            following = out[i + 1] if i + 1 < len(out) else None
            if following not in VERIFY_MODES:
                out[i] = "--verify=disk"
    return out


def json_path_of(argv: Sequence[str] | None) -> str | None:
    """The ``--json`` PATH in ``argv`` even when the rest does not parse, or None.

    A usage error still gets its JSON report when the path itself is usable, as every
    other error does; the report then carries only the exit code and the line.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--json", dest="json_path")
    try:
        known, _ = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        path = known.json_path
        check_json_path(path)
    except (UsageError, SystemExit):
        return None
    return path if isinstance(path, str) and path else None
