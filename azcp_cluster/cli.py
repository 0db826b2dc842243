"""The command line: parse arguments into a Config, run, map errors to exit codes.

This module is the one place where an error becomes an exit status and a printed line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from azcp_cluster import __version__
from azcp_cluster.config import AUTH_METHODS, Config, parse_rate, parse_size
from azcp_cluster.errors import EXIT_CODES, AzcpError, InternalError, UsageError, exit_code_for

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


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds greater than zero (got {text!r})")
    return value


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
    p.add_argument("--concurrency", type=int, default=64, help="ranged GETs in flight per rank (default 64)")
    p.add_argument("--block-size", type=_size, default="16MiB", help="bytes per ranged GET (default 16MiB)")
    p.add_argument(
        "--bcast-chunk",
        type=_size,
        default="64MiB",
        help="bytes per broadcast slot; split into MPI calls of at most 1GiB (default 64MiB)",
    )
    p.add_argument(
        "--bcast-pipeline",
        type=int,
        default=4,
        help="broadcasts in flight; memory per rank is pipeline x chunk (default 4 x 64MiB = 256MiB)",
    )
    p.add_argument(
        "--bcast-writers", type=int, default=2, help="threads writing received chunks to disk per rank (default 2)"
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
        help="files larger than this are split into byte ranges fetched by several ranks (default 1GiB)",
    )
    p.add_argument(
        "--source-rank",
        type=int,
        metavar="R",
        help="local SOURCE: the rank that reads it (default: the lowest rank that can see it); no other rank opens it",
    )
    p.add_argument(
        "--download-ranks",
        type=int,
        metavar="K",
        help="only K ranks download from Azure, spread over the nodes (default: every rank); fewer clients "
        "for a throttled account",
    )
    p.add_argument(
        "--max-bandwidth",
        type=_rate,
        metavar="RATE",
        help="cap the cluster's aggregate download, split over the downloading ranks: 25Gbps, 800Mb/s "
        "(bits), 3GiB/s, 500MB/s (bytes) or bytes per second; stays under a storage account's egress "
        "limit instead of meeting its 503s (default: no cap)",
    )
    p.add_argument("--max-retries", type=int, default=5, help="retries per request before giving up (default 5)")
    p.add_argument(
        "--read-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="a request whose response sends nothing for this long is abandoned and retried (default 60)",
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
        action="store_true",
        help="MD5 of every file, computed as the bytes stream (skipped files are read from disk), compared "
        "across ranks and with the blob's Content-MD5; a mismatch exits 7",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list, compare and print the plan (files and bytes per rank); write nothing",
    )
    p.add_argument("--json", metavar="PATH", dest="json_path", help="write the report as JSON to PATH (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal anyway)")
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
    args = build_parser().parse_args(argv)
    return Config(
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
        progress=not args.no_progress,
        auth=args.auth,
        source_rank=args.source_rank,
        download_ranks=args.download_ranks,
        max_bandwidth=args.max_bandwidth,
    ).validate()


def _comm() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``azcp-cluster``: returns the process exit code."""
    try:
        cfg = config_from_args(argv)
    except UsageError as exc:
        # Every rank parses the same arguments; print once (rank 0, or a plain process).
        if _launcher_rank() == 0:
            print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    comm = _comm()
    from azcp_cluster.cluster import redact
    from azcp_cluster.pipeline import run

    try:
        report = run(cfg, comm)
    except AzcpError as exc:
        # The error was agreed by all ranks: every rank exits with its code, rank 0 speaks.
        if comm.Get_rank() == 0:
            print(exc.one_line(), file=sys.stderr)
            rep = getattr(exc, "report", None)
            if cfg.json_path and rep is not None:
                _write_json(rep, cfg.json_path)
        return exc.exit_code
    except BaseException as exc:
        # Not agreed (a bug, or an interrupt outside a stage): the others may be waiting in
        # a collective, so end the whole job rather than hang.
        error = InternalError(f"unexpected {type(exc).__name__}: {redact(str(exc))}", rank=comm.Get_rank())
        print(error.one_line(), file=sys.stderr, flush=True)
        comm.Abort(exit_code_for(error))
        return exit_code_for(error)
    if comm.Get_rank() == 0 and cfg.json_path:
        _write_json(report, cfg.json_path)
    return 0


def _write_json(report: Any, path: str) -> None:
    try:
        report.write_json(path)
    except OSError as exc:
        print(f"azcp-cluster: warning: cannot write the JSON report to {path}: {exc.strerror}", file=sys.stderr)


def _launcher_rank() -> int:
    """This process's rank as the launcher set it, without initialising MPI."""
    import os

    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 0
