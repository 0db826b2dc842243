"""The Python API: stage a dataset from inside an existing mpi4py program.

``stage()`` runs the same stages as the command line, collectively on ``comm``, and returns
the :class:`~azcp_cluster.report.Report` on every rank. Where the CLI would exit with a code,
it raises the same typed error (:class:`~azcp_cluster.errors.AzcpError` and its subclasses)
on every rank, so a training program can catch it everywhere alike.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, TextIO

from azcp_cluster.config import Config, parse_rate, parse_size, shown
from azcp_cluster.errors import UsageError
from azcp_cluster.report import Report, check_json_path

# The keyword options, by kind (the Config fields; sizes also accept "64MiB" strings).
_SIZES = ("block_size", "bcast_chunk", "shard_size")
_INTS = ("concurrency", "bcast_pipeline", "bcast_writers", "max_retries", "source_readers", *_SIZES)
_OPTIONAL_INTS = ("source_rank", "download_ranks", "download_workers")
_BOOLS = ("bcast_direct", "dry_run", "overlap", "resume", "allow_empty")
_FLOATS = ("read_timeout", "connect_timeout")
_OPTIONAL_FLOATS = ("lock_timeout",)
_STRINGS = ("compare", "auth", "lock")
_GLOBS = ("include", "exclude")
OPTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in ("source", "dest"))


def _convert(name: str, value: Any) -> Any:
    """``value`` as the Config field ``name`` holds it, or a :class:`UsageError` naming the option."""
    if name in _SIZES and isinstance(value, str):
        return parse_size(value)
    if name == "max_bandwidth" and isinstance(value, str):
        return parse_rate(value)
    if name == "max_bandwidth" and (value is None or (isinstance(value, int | float) and not isinstance(value, bool))):
        return None if value is None else _float(name, value)
    if name == "download_workers" and value == "auto":
        return None
    if name == "verify" and isinstance(value, bool):
        return "disk" if value else ""  # verify=True: the default mode, as a bare --verify
    if name == "progress" and isinstance(value, bool):
        return "auto" if value else "none"
    if name == "progress" and isinstance(value, str):
        return value
    if name == "verify" and isinstance(value, str):
        return value
    if name in _GLOBS:
        globs = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list | tuple) else None
        if globs is None or not all(isinstance(g, str) for g in globs):
            raise UsageError(f"{name} must be a glob or a list of globs (got {value!r})")
        return globs
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name in _INTS and is_int:
        return value
    if name in _OPTIONAL_INTS and (value is None or is_int):
        return value
    if name in _BOOLS and isinstance(value, bool):
        return value
    if name in _FLOATS and (is_int or isinstance(value, float)):
        return _float(name, value)
    if name in _OPTIONAL_FLOATS and (value is None or is_int or isinstance(value, float)):
        return None if value is None else _float(name, value)
    if name in _STRINGS and isinstance(value, str):
        return value
    if name == "json_path" and (value is None or isinstance(value, str)):
        return value
    raise UsageError(f"option {name} cannot be {shown(value)}")


def _float(name: str, value: float) -> float:
    """``value`` as a float; an int too large for one is a :class:`UsageError`, not an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        raise UsageError(f"option {name} cannot be {shown(value)}: beyond any supported value") from None


def make_config(source: str, dest: str, options: dict[str, Any]) -> Config:
    """Build a validated :class:`Config` from keyword options named like its fields.

    Sizes may be given as byte counts or as strings (``"64MiB"``); ``include`` and
    ``exclude`` as one glob or a list of globs. Anything else raises :class:`UsageError`.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise UsageError(f"unknown option(s) {', '.join(unknown)}; valid: {', '.join(OPTIONS)}")
    if not isinstance(source, str) or not isinstance(dest, str):
        raise UsageError("source and dest must be strings")
    values = {name: _convert(name, value) for name, value in options.items()}
    cfg = Config(source=source, dest=dest, **values).validate()
    check_json_path(cfg.json_path)
    return cfg


def stage(
    source: str,
    dest: str,
    *,
    comm: Any = None,
    out: TextIO | None = None,
    quiet: bool = False,
    credential: Any = None,
    **options: Any,
) -> Report:
    """Stage ``source`` into ``dest`` on every node; collective over ``comm`` (default ``MPI.COMM_WORLD``).

    ``source`` and ``dest`` are as on the command line (a blob URL or a local path; ``{rank}``
    and ``{host}`` expand in ``dest``). ``options`` are the command line's options with
    underscores (``bcast_chunk="64MiB"``, ``compare="etag"``, ``verify=True`` (``"disk"``;
    or ``verify="stream"``), ``lock="fail"``, ...; see
    :data:`OPTIONS`). The report lines go to ``out`` (default stdout) on rank 0 unless
    ``quiet``; ``json_path`` writes the JSON report there (rank 0), as ``--json`` does.

    ``credential`` authorizes a blob source ahead of the URL and the environment: an
    azure-core ``TokenCredential`` (any object with ``get_token(*scopes)``, e.g. from
    azure-identity; each rank asks it for a token when it needs one) or a SAS string. It
    cannot be combined with ``auth`` (the ``--auth`` option).

    Every rank returns the same :class:`Report`, or raises the same :class:`AzcpError`
    (its ``exit_code`` is the CLI's); the error's ``report`` attribute holds the partial report.
    """
    from azcp_cluster.pipeline import run

    cfg = make_config(source, dest, options)
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    sink = io.StringIO() if quiet else out
    return run(cfg, comm, out=sink, credential=credential)  # it writes the JSON report (rank 0)


__all__ = ["OPTIONS", "make_config", "stage"]
