"""The dry run's file list: what the run would do to each file, in how many copies. Pure code.

Rank 0 prints the cluster's picture, from the diff every rank agreed on (the same decision
the real run then acts on: survey.diff, not a second look at DEST). One line per file, in
columns a script can cut::

    new       1.00 GiB  4/4  ckpt/model-00001.safetensors
    peer     12.00 KiB  1/4  ckpt/config.json
    skip     20.00 KiB  4/4  ckpt/tokenizer.json
    delete    3.00 KiB  2/4  ckpt/old.bin

the action (``new``: no node has it, it comes from SOURCE; ``peer``: some node has it and
the others get it from there, not from SOURCE; ``resume``: some node kept blocks of it from
a stopped run, only the rest moves; ``skip``: every node has it; ``delete``: ``--delete``
removes it), the file's size, the copies the action concerns out of the run's copies (a
copy: one node's DEST, the word of the ``[cluster]`` line; those that lack the file, for
``skip`` those that have it, for ``delete`` those whose DEST holds it), and the path below
DEST (the rest of the line, spaces and all). Then one total line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from azcp_cluster.core.config import format_bytes
from azcp_cluster.core.errors import printable
from azcp_cluster.core.model import FileEntry

# The actions, in the order the total names them.
ACTIONS = ("new", "peer", "resume", "skip", "delete")


def action_of(index: int, moving: set[int], holders: Sequence[tuple[int, ...]], partial: Mapping[int, object]) -> str:
    """What the run does to file ``index`` (see the module's docstring)."""
    if index not in moving:
        return "skip"
    if index in partial:
        return "resume"
    return "peer" if holders[index] else "new"


def file_lines(
    files: Sequence[FileEntry],
    transfer: Sequence[int],
    holders: Sequence[tuple[int, ...]],
    partial: Mapping[int, object],
    stale_by: Sequence[Sequence[tuple[str, int]]],
) -> list[str]:
    """Every file's line, then every file ``--delete`` removes, then the total (``stale_by``: per
    copy, the (path, size) its DEST would lose; its length is the number of copies)."""
    copies = max(1, len(stale_by))
    width = len(f"{copies}/{copies}")
    moving = set(transfer)
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    lines = []

    def line(action: str, size: int, concerned: int, path: str) -> str:
        counts[action] += 1
        sizes[action] += size
        return f"{action:<8} {format_bytes(size):>10}  {f'{concerned}/{copies}':>{width}}  {printable(path)}"

    for i, f in enumerate(files):
        action = action_of(i, moving, holders, partial)
        concerned = copies if action == "skip" else copies - len(holders[i])
        lines.append(line(action, f.size, concerned, f.path))
    doomed: dict[str, tuple[int, int]] = {}  # path -> (size in the first copy that has it, copies)
    for stale in stale_by:
        for path, size in stale:
            first, seen = doomed.get(path, (size, 0))
            doomed[path] = (first, seen + 1)
    for path in sorted(doomed):
        size, seen = doomed[path]
        lines.append(line("delete", size, seen, path))
    return [*lines, total_line(counts, sizes, copies)]


def total_line(counts: Mapping[str, int], sizes: Mapping[str, int], copies: int) -> str:
    """``[dry-run] 27 files: 20 new (96.02 MiB), 7 skip (1.20 MiB); 2 delete (3.00 KiB) on 4 copies``
    (an action no file takes is left out)."""
    listed = sum(n for action, n in counts.items() if action != "delete")
    parts = [f"{counts[a]} {a} ({format_bytes(sizes[a])})" for a in ACTIONS if counts.get(a) and a != "delete"]
    text = f"[dry-run] {listed} file{'' if listed == 1 else 's'}" + (f": {', '.join(parts)}" if parts else "")
    if counts.get("delete"):
        text += f"; {counts['delete']} delete ({format_bytes(sizes['delete'])})"
    return text + (f" on {copies} copies" if copies > 1 else "")
