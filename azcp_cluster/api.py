"""The Python API: stage a dataset from inside an existing mpi4py program.

``stage()`` runs the same stages as the command line, collectively on ``comm``, and returns
the :class:`~azcp_cluster.run.report.Report` on every rank. Where the CLI would exit with a code,
it raises the same typed error (:class:`~azcp_cluster.core.errors.AzcpError` and its subclasses)
on every rank, so a training program can catch it everywhere alike.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, TextIO

from azcp_cluster.core.comm import Comm
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import UsageError
from azcp_cluster.options import check_source_kind, coerce
from azcp_cluster.run.report import Report, check_json_path

OPTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in ("source", "dest"))


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
    values = {name: coerce(name, value) for name, value in options.items()}  # as the command line reads them
    cfg = Config(source=source, dest=dest, **values).validate()
    check_source_kind(cfg)  # an option for the other kind of SOURCE, as on the command line
    check_json_path(cfg.json_path)
    return cfg


def stage(
    source: str,
    dest: str,
    *,
    comm: Comm | None = None,
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

    if quiet:  # nothing printed: no progress either, unless asked for
        options.setdefault("progress", "none")
    cfg = make_config(source, dest, options)
    if comm is None:
        from azcp_cluster.run.mpi import world

        comm = world()
    sink = io.StringIO() if quiet else out
    return run(cfg, comm, out=sink, credential=credential)  # it writes the JSON report (rank 0)


__all__ = ["OPTIONS", "make_config", "stage"]
