"""The Python API: stage a dataset from inside an existing mpi4py program.

``stage()`` runs the same stages as the command line, collectively on ``comm``, and returns
the :class:`~azcp_cluster.run.report.Report` on every rank. Where the CLI would exit with a code,
it raises the same typed error (:class:`~azcp_cluster.core.errors.AzcpError` and its subclasses)
on every rank, so a training program can catch it everywhere alike.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any, TextIO

from azcp_cluster.core.comm import Comm
from azcp_cluster.core.config import Config, parse_rate, parse_size, shown
from azcp_cluster.core.errors import UsageError
from azcp_cluster.options import OPTIONS as OPTION_TABLE
from azcp_cluster.options import check_source_kind, did_you_mean
from azcp_cluster.run.report import Report, check_json_path

OPTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in ("source", "dest"))


def make_config(source: str, dest: str, options: dict[str, Any]) -> Config:
    """Build a validated :class:`Config` from keyword options named like its fields.

    Sizes may be given as byte counts or as strings (``"64MiB"``); ``include`` and
    ``exclude`` as one glob or a list of globs. Anything else raises :class:`UsageError`.
    """
    check_option_keys(options)
    if not isinstance(source, str) or not isinstance(dest, str):
        raise UsageError("source and dest must be strings")
    values = {name: coerce(name, value) for name, value in options.items()}  # as the command line reads them
    cfg = Config(source=source, dest=dest, **values).validate()
    check_source_kind(cfg)  # an option for the other kind of SOURCE, as on the command line
    check_json_path(cfg.json_path)
    return cfg


def check_option_keys(options: dict[str, object]) -> None:
    """Refuse a keyword option no Config field has, with the command line's suggestion
    (:func:`azcp_cluster.options.did_you_mean`) for each, and the valid names when one has none."""
    unknown = sorted((name for name in options if name not in OPTIONS), key=str)  # a key may be any object
    if not unknown:
        return
    hints = [(shown(name) if not isinstance(name, str) else name, did_you_mean(str(name), OPTIONS)) for name in unknown]
    named = ", ".join(f"{name} ({hint})" if hint else name for name, hint in hints)
    valid = "" if all(hint for _, hint in hints) else f"; valid: {', '.join(OPTIONS)}"
    raise UsageError(f"unknown option(s) {named}{valid}")


def coerce(field: str, value: object) -> Any:
    """The Python API's keyword option ``field`` as its Config field holds it, read by the kind
    of the option that sets it (:data:`azcp_cluster.options.OPTIONS`, :data:`_READS`); a
    :class:`UsageError` naming it otherwise."""
    option = next((o for o in OPTION_TABLE if o.field == field and o.kind != "alias"), None)
    if option is None:
        raise UsageError(f"unknown option {field}")
    # None is "not given" where the field's default is None, and for these kinds whatever it is.
    if value is None and (getattr(Config, field, 0) is None or option.kind in ("rate", "workers", "path")):
        return None
    if field == "progress" and isinstance(value, bool):  # the one choice that also reads as on or off
        return "auto" if value else "none"
    if option.kind == "globs":
        return _globs(field, value)
    for accepts, read in _READS.get(option.kind, ()):
        if accepts(value):
            return read(field, value)
    raise UsageError(f"option {field} cannot be {shown(value)}")


def _is_int(value: object) -> bool:
    """Whether ``value`` is a whole number: a bool is not, though Python counts it one."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """Whether ``value`` is a whole or a floating-point number (not a bool)."""
    return _is_int(value) or isinstance(value, float)


def _is_text(value: object) -> bool:
    """Whether ``value`` is a string, read as the command line reads the option's word."""
    return isinstance(value, str)


def _is_bool(value: object) -> bool:
    """Whether ``value`` is True or False."""
    return isinstance(value, bool)


def _is_auto(value: object) -> bool:
    """Whether ``value`` is ``"auto"``, as ``--download-workers auto`` is written."""
    return bool(value == "auto")


def _as_is(field: str, value: object) -> object:
    """``value`` unchanged: it is already what the field holds."""
    return value


def _float(field: str, value: float) -> float:
    """``value`` as a float; an int too large for one is a :class:`UsageError`, not an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        raise UsageError(f"option {field} cannot be {shown(value)}: beyond any supported value") from None


# The values each kind of option takes from the API, as (accepts, read into the field's value),
# tried in order: any other value is refused, naming the option. No two of one kind accept
# the same value. Text is read as argparse reads the option's word; "globs" is _globs's.
_READS: dict[str, tuple[tuple[Callable[[object], bool], Callable[[str, Any], object]], ...]] = {
    "size": ((_is_text, lambda _, text: parse_size(text)), (_is_int, _as_is)),
    "int": ((_is_int, _as_is),),
    "seconds": ((_is_number, _float),),
    "rate": ((_is_text, lambda _, text: parse_rate(text)), (_is_number, _float)),
    "workers": ((_is_auto, lambda _, auto: None), (_is_int, _as_is)),
    "flag": ((_is_bool, _as_is),),
    "negated": ((_is_bool, _as_is),),
    "verify": ((_is_bool, lambda _, on: "disk" if on else ""), (_is_text, _as_is)),  # True: a bare --verify
    "choice": ((_is_text, _as_is),),
    "path": ((_is_text, _as_is),),
}


def _globs(field: str, value: object) -> tuple[str, ...]:
    """``include`` or ``exclude``: one glob, or a list or tuple of them, as a tuple."""
    globs = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list | tuple) else None
    if globs is None or not all(isinstance(g, str) for g in globs):
        raise UsageError(f"{field} must be a glob or a list of globs (got {value!r})")
    return globs


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
        from azcp_cluster.run.rails import bind_before_mpi

        bind_before_mpi(cfg.rails)  # before MPI starts, if this call starts it (--rails)
        comm = world()
    sink = io.StringIO() if quiet else out
    return run(cfg, comm, out=sink, credential=credential)  # it writes the JSON report (rank 0)


__all__ = ["OPTIONS", "make_config", "stage"]
