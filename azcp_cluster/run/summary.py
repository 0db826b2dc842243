"""The one human line at the end of a run: what was copied, to how many copies, how long it took.

The report's stage lines above it are the contract scripts parse (and ``--json`` the rest);
this line is for the person who ran it, and the one line ``-q`` keeps.
"""

from __future__ import annotations

from azcp_cluster.core.config import format_bytes
from azcp_cluster.run.report import Report


def counted(count: int, noun: str, plural: str = "") -> str:
    """``1 file``, ``27 files``, ``1 retry``, ``2 retries`` (``plural``: where not noun + s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def _copies(report: Report) -> str:
    """``4 copies``: the report's one word for a node's DEST (one per host and DEST, as ``[cluster]`` counts them)."""
    return counted(report.writers, "copy", "copies")


def _copies_of(report: Report) -> str:
    """The copies ``--delete`` removed files from (``1 copy``, ``2 copies``)."""
    return counted(report.deleted_copies, "copy", "copies")


def summary_line(report: Report) -> str | None:
    """``azcp-cluster: 27 files, 24.02 MiB to 4 copies (96.08 MiB written) in 3.51 s, 0 retries``
    (and `` (3 files already present)`` where some were),
    or ``azcp-cluster: nothing to do: 27 files already present in 4 copies``; None for a failed
    run (its error line says how it ended) or a dry run (its plan says what it would do).

    The bytes written over all the copies are given where every copy wrote every file copied
    (none was on some node already, nothing kept from a stopped run); otherwise they are not
    known to rank 0 and the line leaves them out.
    """
    if report.exit_code or report.error or report.dry_run:
        return None
    removed = ""
    if report.deleted_files:  # --delete: never a run that removed files said to have done nothing
        removed = f"; {counted(report.deleted_distinct_files, 'file')} not in SOURCE removed from {_copies_of(report)}"
    if report.transfer_files == 0:
        present = f"{counted(report.files, 'file')} already present in {_copies(report)}"
        if removed:
            return f"azcp-cluster: nothing to copy: {present}{removed}"
        return f"azcp-cluster: nothing to do: {present}"
    moved = report.bytes - report.skipped_bytes
    present = f" ({counted(report.skipped_files, 'file')} already present)" if report.skipped_files else ""
    whole = report.peer_files == 0 and report.resumed_files == 0 and report.writers > 1
    written = f" ({format_bytes(moved * report.writers)} written)" if whole and moved else ""
    return (
        f"azcp-cluster: {counted(report.transfer_files, 'file')}, {format_bytes(moved)} to {_copies(report)}"
        f"{written} in {report.stages['total'].seconds:.2f} s, {counted(report.retries, 'retry', 'retries')}{present}"
        f"{removed}"
    )
