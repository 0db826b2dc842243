"""The command line's options: argv into one validated :class:`Config` (argparse, units, ranges).

The entry point (signals, MPI's start and end, errors into exit codes) is :mod:`azcp_cluster.cli`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from azcp_cluster import __version__
from azcp_cluster.core.chain import FANOUT_METHODS, MAX_PIECE_OPTION, MIN_PIECE_OPTION
from azcp_cluster.core.config import (
    AUTH_METHODS,
    COMPARE_MODES,
    LOCK_MODES,
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
    MIN_PEER_TIMEOUT,
    MIN_SHARD_SIZE,
    MIN_TIMEOUT,
    PROGRESS_MODES,
    RAIL_MODES,
    UNITS,
    VERBOSITY_LEVELS,
    VERIFY_MODES,
    Config,
    parse_rate,
    parse_size,
    shown,
)
from azcp_cluster.core.errors import EXIT_CODES, UsageError
from azcp_cluster.core.source import is_url
from azcp_cluster.run.report import check_json_path

EXAMPLES = """\
examples:
  # Slurm, one rank per node: a model from a blob container to local NVMe
  srun --ntasks-per-node=1 --mpi=pmix azcp-cluster \\
      https://myaccount.blob.core.windows.net/models/llama-70b /mnt/nvme/llama
  # mpiexec on 8 hosts: a checkpoint on a shared filesystem, read once, verified
  mpiexec -n 8 -ppn 1 azcp-cluster /lustre/ckpt/step-900 /mnt/nvme/ckpt --verify
"""
EPILOG = (
    EXAMPLES
    + "\nexit codes:\n"
    + "\n".join(
        textwrap.fill(f"  {code:<3}  {text}", 79, subsequent_indent=" " * 7) for code, text in EXIT_CODES.items()
    )
)

DESCRIPTION = f"""\
Stage one dataset onto every node: SOURCE is listed once, each byte is read
from it once (Azure: every downloading rank fetches only its share), then a
fan-out over MPI between nodes brings every file to DEST on every node. Launch
one rank per node, or more: every rank downloads, one per node writes DEST.

SOURCE  https://ACCOUNT.blob.core.windows.net/CONTAINER[/PREFIX][?SAS], or
        http(s)://HOST:PORT/ACCOUNT/CONTAINER[/PREFIX][?SAS] (an emulator).
        PREFIX is a virtual directory (.../ckpt copies ckpt/**, not ckpt-x/);
        a blob named exactly PREFIX is copied alone. Or a local path (a file
        or a tree, e.g. on NFS, Lustre, blobfuse): one rank reads it.
DEST    a directory, made if missing; {{rank}} and {{host}} expand per rank.

Credentials, first match wins: SAS in the URL, AZURE_STORAGE_CONNECTION_STRING,
AZURE_STORAGE_ACCOUNT + AZURE_STORAGE_KEY, AZURE_STORAGE_SAS_TOKEN, then (https)
workload identity, managed identity, the Azure CLI (az login), anonymous.
--auth METHOD (or AZCP_AUTH) forces one.

{textwrap.fill(UNITS, 79)}
"""

# The help's groups, in order.
GROUPS = ("what to copy", "download", "broadcast", "checks and output", "advanced")


@dataclass(frozen=True)
class Option:
    """One command-line option: its flag, the Config field it sets, and how its value is read.

    ``kind``: ``size`` (64MiB), ``int``, ``seconds``, ``rate`` (25Gbps), ``workers`` (N or
    auto), ``choice`` (one of ``choices``), ``flag`` (sets the field True), ``negated``
    (``--no-X``: sets it False), ``alias`` (sets the field to ``value``), ``globs``
    (repeatable), ``path``, ``verify`` (an optional MODE). The API's keyword options are the
    fields, read by the same kinds (:func:`azcp_cluster.api.coerce`).

    ``source``: the kind of SOURCE the option is for, :data:`BLOB` or :data:`LOCAL` ("": both).
    Set for the other kind, it would be ignored, so it is refused (:func:`check_source_kind`).
    """

    flag: str
    field: str
    group: str
    kind: str
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    value: Any = None  # an alias's value
    source: str = ""  # BLOB or LOCAL: the only kind of SOURCE it applies to ("": both)
    short: str = ""  # a one-letter flag as well (-q, -v)


# The kinds of SOURCE an option may be for alone (Option.source), and what the other kind does instead.
BLOB = "blob URL"
LOCAL = "local"
_INSTEAD = {
    BLOB: "a local SOURCE is read by its reader ranks, and nothing is downloaded",
    LOCAL: "a blob URL is downloaded by the downloading ranks (--download-ranks), and no rank reads a path",
}


def _range(lo: int, hi: int) -> str:
    return f"{_units(lo)} to {_units(hi)}"


def _units(n: int) -> str:
    """A size limit as the options are written: ``64KiB``, ``16GiB``."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


OPTIONS: tuple[Option, ...] = (
    # what to copy
    Option("--include", "include", GROUPS[0], "globs",
           "copy only paths (below the prefix) matching GLOB; repeatable; '*' matches across '/'", "GLOB"),
    Option("--exclude", "exclude", GROUPS[0], "globs", "skip paths matching GLOB; repeatable", "GLOB"),
    Option("--compare", "compare", GROUPS[0], "choice",
           "when a file in DEST counts as there already: 'size' (the same size; a blob replaced by one of "
           "the same size is NOT copied again), 'etag' (the size and the ETag in DEST's manifest), 'md5' "
           "(hash the local file against the blob's Content-MD5 or the manifest's), 'none' (copy all); "
           "default size", "MODE", COMPARE_MODES),
    Option("--allow-empty", "allow_empty", GROUPS[0], "flag",
           "a SOURCE (prefix, directory, --include/--exclude) that yields no file is an empty copy (exit 0 "
           "with a warning); default: exit 3 naming it, as a typo in a job script should"),
    Option("--dry-run", "dry_run", GROUPS[0], "flag",
           "list, compare and print each file's action (new, peer, resume, skip, delete) and the plan; "
           "write nothing"),
    Option("--delete", "delete", GROUPS[0], "flag",
           "a mirror: once the copy is complete on every node, remove from each DEST the files SOURCE no "
           "longer has (of those the filters select; never a link)"),
    # download
    Option("--concurrency", "concurrency", GROUPS[1], "int",
           f"ranged GETs in flight per rank, 1 to {MAX_CONCURRENCY} (default 64)", "N", source=BLOB),
    Option("--block-size", "block_size", GROUPS[1], "size",
           f"bytes per ranged GET, {_range(MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)} (default 16MiB)", "SIZE", source=BLOB),
    Option("--shard-size", "shard_size", GROUPS[1], "size",
           f"files larger than SIZE are split into ranges fetched by several ranks (finer, down to "
           f"8MiB, where that shares the download out more evenly); at least {_units(MIN_SHARD_SIZE)} "
           "(default 1GiB)", "SIZE"),
    Option("--max-bandwidth", "max_bandwidth", GROUPS[1], "rate",
           "cap the cluster's download, split over the downloading ranks: 25Gbps, 800Mb/s (bits), 3GiB/s "
           "(bytes) or bytes per second; keeps a job under a storage account's egress limit instead of "
           f"meeting its 503s; {MIN_BANDWIDTH} B/s to 8000Tbps (default: no cap)", "RATE", source=BLOB),
    Option("--download-ranks", "download_ranks", GROUPS[1], "int",
           "only N ranks download, spread over the nodes (default: every rank); fewer clients for a "
           "throttled account", "N", source=BLOB),
    Option("--auth", "auth", GROUPS[1], "choice",
           "force one credential: " + ", ".join(AUTH_METHODS[1:]) + "; default auto (the first that "
           "applies, or AZCP_AUTH)", "METHOD", AUTH_METHODS, source=BLOB),
    # broadcast
    Option("--bcast-chunk", "bcast_chunk", GROUPS[2], "size",
           f"bytes per fan-out slot, {_range(MIN_BCAST_CHUNK, MAX_BCAST_CHUNK)}; sent in MPI calls of at "
           "most 1GiB (default 16MiB; 64MiB with --fanout ibcast)", "SIZE"),
    Option("--fanout", "fanout", GROUPS[2], "choice",
           "how a part goes from node to node: 'chain' or 'ring' (one transport: pipelined point-to-point "
           "messages along the hosts, every link carrying each byte once, whatever the node count), "
           "'ibcast' (MPI's broadcast); default auto: the chain, unless a probe at start-up finds the "
           "broadcast faster", "METHOD", FANOUT_METHODS),
    Option("--rails", "rails", GROUPS[2], "choice",
           "several ranks per node, several fabric NICs: 'auto' (default) binds local rank i to the node's "
           "i-th active fabric device (InfiniBand ports, else ib* interfaces) before MPI starts, where no "
           "UCX_NET_DEVICES, FI_TCP_IFACE or OMPI_MCA_btl_tcp_if_* binds it already; 'off' leaves MPI "
           "alone", "MODE", RAIL_MODES),
    Option("--source-rank", "source_rank", GROUPS[2], "int",
           "local SOURCE: the rank that reads it (default: the lowest that sees it); no other opens it",
           "RANK", source=LOCAL),
    Option("--source-readers", "source_readers", GROUPS[2], "int",
           "local SOURCE on a shared filesystem (Lustre, NFS with several servers): N ranks on different "
           "nodes read disjoint, balanced parts of it (default 1)", "N", source=LOCAL),
    # checks and output
    Option("--verify", "verify", GROUPS[3], "verify",
           "MD5 of every file, compared across nodes and with the blob's Content-MD5, and every copy's "
           "CRC-32 with that of the bytes as they came from the source (exit 7 on a mismatch). MODE "
           "'disk' (a bare --verify): every copy read back after its fsync; 'stream': hashed as the "
           "bytes pass (files not sent are read back)", "MODE", VERIFY_MODES),
    Option("--json", "json_path", GROUPS[3], "path",
           "write the report as JSON to PATH (rank 0); not a directory, not inside DEST", "PATH"),
    Option("--progress", "progress", GROUPS[3], "choice",
           "rank 0's progress on stderr: 'bar' (one line redrawn), 'lines' (a status line each 5%% or "
           "10 s, for logs), 'none'; default auto: the bar on a terminal, lines elsewhere (mpiexec, srun, "
           "a log)", "MODE", PROGRESS_MODES),
    Option("--no-progress", "progress", GROUPS[3], "alias", "the same as --progress none", value="none"),
    Option("--quiet", "verbosity", GROUPS[3], "alias",
           "print only errors, warnings and the final summary line (no stage lines, no progress)",
           value="quiet", short="-q"),
    Option("--verbose", "verbosity", GROUPS[3], "alias",
           "also print which credential is sent and the libraries' log lines (azure-identity's, "
           "azure-core's) on stderr",
           value="verbose", short="-v"),
    # The Python API's form of -q and -v (no flag of its own).
    Option("", "verbosity", GROUPS[3], "choice",
           "what reaches the terminal: 'quiet' (-q), 'normal' (default), 'verbose' (-v)", "MODE",
           VERBOSITY_LEVELS),
    Option("--log-file", "log_file", GROUPS[3], "path",
           "append every line of the run to PATH, after a header (UTC time, rank), whatever -q or -v "
           "say: the stage lines, the summary, errors and the libraries' log records; {rank} and {host} "
           "expand as in DEST (without {rank}, rank 0 alone writes it; other ranks log their own "
           "warnings and errors); a regular file, never through a link; not inside DEST or SOURCE", "PATH"),
    Option("--lock", "lock", GROUPS[3], "choice",
           "another run on the same DEST: 'wait' for it (see --lock-timeout) or 'fail' at once; exit 9 if "
           "it is still there (default wait)", "MODE", LOCK_MODES),
    Option("--lock-timeout", "lock_timeout", GROUPS[3], "seconds",
           f"how long --lock wait waits before exit 9; {MIN_TIMEOUT:g} to {MAX_LOCK_TIMEOUT:.0f} (7 days) "
           "(default: no limit)", "SECONDS"),
    # advanced
    Option("--download-workers", "download_workers", GROUPS[4], "workers",
           f"processes under each downloading rank making its ranged GETs (1 to {MAX_DOWNLOAD_WORKERS}; 1: "
           "the rank itself); auto (default): the rank measures its rate and the idle CPUs and hands "
           "its share to workers (at most 8) only where they are predicted to shorten it", "N", source=BLOB),
    Option("--max-retries", "max_retries", GROUPS[4], "int",
           f"retries per request before giving up, 0 to {MAX_RETRIES_LIMIT} (default 5)", "N", source=BLOB),
    Option("--read-timeout", "read_timeout", GROUPS[4], "seconds",
           "a request whose response sends nothing for SECONDS, or a body under 4 KiB/s over SECONDS, "
           "is dropped and retried; "
           f"{MIN_TIMEOUT:g} to {MAX_READ_TIMEOUT:.0f} (default 60)", "SECONDS", source=BLOB),
    Option("--peer-timeout", "peer_timeout", GROUPS[4], "seconds",
           "a rank that sends no pulse for SECONDS (stopped, frozen, cut off) is named and the job ended, "
           f"exit 10; 0: never (a rank in a debugger); {MIN_PEER_TIMEOUT:g} to {MAX_READ_TIMEOUT:.0f} "
           "(default 30)", "SECONDS"),
    # The Python API only (no flag): how long a connection to Azure may take to open.
    Option("", "connect_timeout", GROUPS[4], "seconds",
           f"seconds a connection may take to open; {MIN_TIMEOUT:g} to {MAX_READ_TIMEOUT:.0f} (default 30)",
           source=BLOB),
    Option("--bcast-pipeline", "bcast_pipeline", GROUPS[4], "int",
           f"fan-out slots in flight, 1 to {MAX_BCAST_PIPELINE}; memory per writer is N x chunk "
           "(default 4, so 4 x 16MiB = 64MiB)", "N"),
    Option("--fanout-piece", "fanout_piece", GROUPS[4], "size",
           f"bytes per message of a chain, {_range(MIN_PIECE_OPTION, MAX_PIECE_OPTION)} (default: the "
           "largest power of two from 256KiB to 4MiB whose pipe fill costs 2%% of the fan-out)", "SIZE"),
    Option("--bcast-writers", "bcast_writers", GROUPS[4], "int",
           f"threads writing received slots to disk per node, 1 to {MAX_BCAST_WRITERS} (default 2)", "N"),
    Option("--no-bcast-direct", "bcast_direct", GROUPS[4], "negated",
           "write received slots, and read back the downloads to send, through the page cache instead "
           "of O_DIRECT"),
    Option("--no-overlap", "overlap", GROUPS[4], "negated",
           "download everything, then fan it out (default: each part goes out as soon as it lands)", source=BLOB),
    Option("--no-resume", "resume", GROUPS[4], "negated",
           "copy every missing file whole, ignoring (and removing) a stopped run's block journal "
           "(default: keep the blocks it recorded and move only the rest)"),
)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """argparse that raises our UsageError instead of printing from every rank and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


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


_TYPES: dict[str, Callable[[str], Any]] = {
    "size": _size,
    "int": _integer,
    "seconds": _seconds,
    "rate": _rate,
    "workers": _workers,
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The help within 80 columns whatever the terminal (a log, a narrow pane), never wider."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=min(80, shutil.get_terminal_size((80, 24)).columns) - 1, max_help_position=26)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, built from :data:`OPTIONS` (also used by the docs tests)."""
    description = f"{DESCRIPTION}\n{source_kinds_text()}\n"
    # No abbreviations: `--del` in a job script must not quietly mean --delete.
    p = _Parser(
        prog="azcp-cluster", description=description, epilog=EPILOG, formatter_class=_Formatter, allow_abbrev=False
    )
    p.add_argument("--version", action="version", version=f"azcp-cluster {__version__}")
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    copy = groups[GROUPS[0]]
    copy.add_argument("source", metavar="SOURCE", help="a blob container URL (a prefix, a SAS), or a local path")
    copy.add_argument("dest", metavar="DEST", help="the directory on every node ({rank}, {host} expanded)")
    for option in OPTIONS:
        if not option.flag:
            continue  # the Python API's only
        group = groups[option.group]
        # No defaults here: an option not given leaves its Config field at the one default (config.py).
        common: dict[str, Any] = {"help": option.help, "default": argparse.SUPPRESS}
        names = (option.short, option.flag) if option.short else (option.flag,)
        if option.kind in ("flag", "negated"):
            group.add_argument(option.flag, dest=option.flag, action="store_true", **common)
        elif option.kind == "alias":
            group.add_argument(*names, dest=option.flag, action="store_const", const=option.value, **common)
        elif option.kind == "globs":
            group.add_argument(option.flag, dest=option.flag, action="append", metavar=option.metavar, **common)
        elif option.kind == "verify":
            group.add_argument(option.flag, dest=option.flag, nargs="?", const="disk", choices=option.choices,
                               metavar=option.metavar, **common)  # fmt: skip
        elif option.kind == "choice":
            group.add_argument(option.flag, dest=option.flag, choices=option.choices, metavar=option.metavar,
                               **common)  # fmt: skip
        else:
            kind = _TYPES.get(option.kind, str)
            group.add_argument(option.flag, dest=option.flag, type=kind, metavar=option.metavar, **common)
    return p


def config_from_args(argv: Sequence[str] | None) -> Config:
    """Parse the command line into a validated :class:`Config`."""
    parser = build_parser()
    argv = normalise_verify(sys.argv[1:] if argv is None else argv)
    check_option_names(argv, parser)
    given = vars(parser.parse_args(argv))
    if "--quiet" in given and "--verbose" in given:  # one field: the later would silently win
        raise UsageError("-q (--quiet) and -v (--verbose) contradict each other; give one of them")
    fields: dict[str, Any] = {}
    for option in OPTIONS:  # in table order: --no-progress after --progress, as argparse would have it
        if not option.flag or option.flag not in given:
            continue
        value = given[option.flag]
        if option.kind == "negated":
            value = False
        elif option.kind == "globs":
            value = tuple(value)
        fields[option.field] = value
    cfg = Config(source=given["source"], dest=given["dest"], **fields).validate()
    check_source_kind(cfg)
    check_json_path(cfg.json_path)
    return cfg


def check_source_kind(cfg: Config) -> None:
    """Refuse an option set for the other kind of SOURCE than ``cfg``'s (:attr:`Option.source`):
    a blob URL's download options with a local path, a local path's reader options with a URL.

    Such an option would have no effect at all (``--max-bandwidth`` with a local SOURCE read it
    uncapped), which a job script's author would take for a setting that holds; nothing caps
    or tunes a local reader. Set means other than its default, so the command line and the
    API decide alike (an API caller may pass every option at its default whatever the SOURCE).
    """
    other = LOCAL if is_url(cfg.source) else BLOB  # the kind this SOURCE is not
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    named = [o.flag or o.field for o in OPTIONS if o.source == other and getattr(cfg, o.field) != defaults[o.field]]
    if named:
        names = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
        verb, them = ("is", "it") if len(named) == 1 else ("are", "them")
        raise UsageError(f"{names} {verb} for a {other} SOURCE only: {_INSTEAD[other]}; leave {them} out")


def source_kinds_text() -> str:
    """The help's paragraph on the options for one kind of SOURCE only, from :data:`OPTIONS`."""
    flags = {kind: ", ".join(o.flag for o in OPTIONS if o.source == kind and o.flag) for kind in (BLOB, LOCAL)}
    return textwrap.fill(
        f"For a blob URL only: {flags[BLOB]}. For a local SOURCE only: {flags[LOCAL]}. Set for the "
        "other kind of SOURCE, they exit 2.",
        79,
        break_on_hyphens=False,  # an option's name on one line
    )


def did_you_mean(name: str, known: Iterable[str]) -> str | None:
    """``did you mean X?`` for the known name closest to a misspelled ``name``, or None when none is close.

    The one suggestion for an unknown option, on the command line (``--bcast-chunks``) and in the
    Python API (``bcast_chunks=``), so both propose the same way.
    """
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else None


def check_option_names(argv: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """Refuse an option name the parser does not know, naming it and the closest known one.

    argparse alone would take the misspelled option's value for SOURCE and report the real
    DEST as the unrecognized argument (``--bcast-chunks 64MiB URL DEST``). An abbreviation is
    refused too, naming the option it starts (``--del`` in a job script must not quietly mean
    ``--delete``); nothing after ``--`` is an option.
    """
    known = sorted({name for action in parser._actions for name in action.option_strings if name.startswith("--")})
    for token in argv:
        if token == "--":
            return
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        if name in known:
            continue
        starts = [option for option in known if option.startswith(name)]
        hint = (f"did you mean {starts[0]}?" if len(starts) == 1 else None) or did_you_mean(name, known) or "see --help"
        label = name if name.isprintable() and len(name) <= 64 else shown(name)
        raise UsageError(f"unrecognized option {label} ({hint})")


def normalise_verify(argv: Sequence[str]) -> list[str]:
    """``--verify`` not followed by a mode becomes ``--verify=disk``.

    The option takes an optional MODE, and argparse would otherwise take the next word
    for it: ``--verify SRC DEST`` must keep SRC. Nothing after ``--`` is touched.
    """
    out = list(argv)
    for i, token in enumerate(out):
        if token == "--":
            break
        if token == "--verify":
            following = out[i + 1] if i + 1 < len(out) else None
            if following not in VERIFY_MODES:
                out[i] = "--verify=disk"
    return out


def json_path_of(argv: Sequence[str] | None) -> str | None:
    """The ``--json`` PATH in ``argv`` even when the rest does not parse, or None.

    A usage error still gets its JSON report when the path itself is usable, as every
    other error does; no run started, so every other field of that report is at its empty value.
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
