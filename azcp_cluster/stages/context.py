"""What every stage of a run shares: its fixed facts, the handles to close, two messages.

The facts (configuration, rank, DEST, the cluster) do not change once the run
starts. The handles (DEST's tree and lock, the node's I/O, the communicators) are opened
by the stages that need them and closed here, in one call, whatever stage failed. The
node's I/O (buffers, writers, journal) has one owner, :class:`~azcp_cluster.stages.nodeio.NodeIO`:
allocate makes each part, the transfer stage ends a part early when it is done with it.
Results move between stages as frozen values, never through this object; each stage's
figures go to ``record`` (the run's report's, run/figures.py), the report's one writer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from azcp_cluster.core.comm import Comm
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import InternalError, LocalFSError
from azcp_cluster.core.source import is_url
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.localfs import Made, expand_dest, free_bytes
from azcp_cluster.run import collector
from azcp_cluster.run.cluster import Cluster, StageOutcome
from azcp_cluster.run.console import Console, say
from azcp_cluster.run.figures import Recorder
from azcp_cluster.run.notices import NOTICES
from azcp_cluster.run.progress import BAR_NEEDS_A_TERMINAL, resolve_mode
from azcp_cluster.stages.nodeio import NodeIO

if TYPE_CHECKING:
    from azcp_cluster.dest.destlock import DestLock


T = TypeVar("T")


def log_path_for(template: str | None, rank: int, host: str) -> str | None:
    """This rank's ``--log-file``, ``{rank}`` and ``{host}`` expanded as in DEST; None where this
    rank writes none (no ``{rank}`` in it: rank 0 alone writes it, so ranks never share a file)."""
    if not template or (rank != 0 and "{rank}" not in template):
        return None
    return expand_dest(template, rank, host)


class RunContext:
    """One run on one rank: the facts every stage reads and the handles closed at its end."""

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        record: Recorder,
        env: Mapping[str, str],
        wall: Callable[[], float],
        console: Console,
        host: str,
        started: float,
        credential: Any = None,
    ) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.record = record  # a stage's figures into the run's report (Report.record)
        self.env = env
        self.wall = wall
        self.console = console  # what reaches the terminal and the log file (run/console.py)
        self.out = console.out
        self.host = host
        self.started = started
        self.credential = credential  # the Python API's credential=, else None
        self.rank = cluster.rank
        NOTICES.start(f"rank {self.rank}")  # this run's retry notices: the first is said at once
        # Absolute, but not normalised: "link/../x" is where the kernel says, not "x".
        self.dest = os.path.join(os.getcwd(), expand_dest(cfg.dest, self.rank, host))
        # Symlinks and "..": two spellings of one directory are still one directory.
        self.dest_identity = os.path.realpath(self.dest)
        self.show_progress = self._progress_mode(cfg.progress)  # bar, lines or none
        # A SOURCE without a scheme is a path: the readers read it, the others receive it.
        self.local = not is_url(cfg.source)
        self.source_root = os.path.abspath(cfg.source) if self.local else ""
        # Where the files come from, as the block journal ties their blocks to it (never a
        # SAS: the query is cut off).
        self.origin = os.path.realpath(self.source_root) if self.local else cfg.source.split("?", 1)[0]
        self._warned_direct = False
        # Handles, opened by the stages and closed by close().
        # DEST opened by its real path (leaders, and downloaders once it exists): every file
        # below it is reached through this handle, never through a link (desttree.py).
        self.tree: DestTree | None = None
        self.dest_lock: DestLock | None = None  # leaders: held from setup to the end of the run
        self.dest_made = Made()  # leaders: the directories setup made for DEST (removed if the run fails, empty)
        self.io = NodeIO()  # the download's buffers, the node writers, the block journal (allocate)
        self.heap = collector.Hold()  # the listing, plan and schedule, frozen (collector.py) until the end
        self._node_comm: Comm | None = None  # the leaders' communicator, for the fan-out (setup)
        self._group_comm: Comm | None = None  # this node's ranks, its leader as rank 0 (setup)

    def _progress_mode(self, requested: str) -> str:
        """What rank 0 shows while a stage runs (progress.resolve_mode, then what the verbosity
        allows); a ``--progress bar`` that gets lines (no terminal on stderr) says so once."""
        mode = self.console.progress_mode(resolve_mode(requested, self.rank))
        if requested == "bar" and mode == "lines":
            self.console.note(BAR_NEEDS_A_TERMINAL)
        return mode

    def split(self, node: Comm, group: Comm) -> None:
        """The communicators setup made: the leaders' (``node``) and this node's ranks' (``group``)."""
        self._node_comm, self._group_comm = node, group

    @property
    def node_comm(self) -> Comm:
        """The leaders' communicator, for the fan-out (its rank 0 the first node's leader)."""
        if self._node_comm is None:
            raise InternalError("the leaders' communicator is used before setup made it")
        return self._node_comm

    @property
    def group_comm(self) -> Comm:
        """This node's ranks, its leader as rank 0."""
        if self._group_comm is None:
            raise InternalError("the node's communicator is used before setup made it")
        return self._group_comm

    def dest_tree(self) -> DestTree:
        """This rank's handle on DEST (opened here by a downloader that is not its node's leader)."""
        if self.tree is None:
            self.tree = DestTree(self.dest, create=not self.cfg.dry_run)
        return self.tree

    def let_dest_be(self, remove: bool) -> None:
        """After ``close``: a failed run removes DEST (and the parents) this run made, if still empty.

        The lock file is gone by then (``close`` removes it while it holds the lock); a
        directory with anything else in it stays, and so does one another run made.
        """
        made, self.dest_made = self.dest_made, Made()
        if remove:
            made.remove()
        else:
            made.close()

    def close(self) -> None:
        """End the node's I/O (its writers after their queued writes, then the journal); release
        DEST; free the communicators."""
        self.io.close()
        if self.dest_lock is not None:
            self.dest_lock.close()
            self.dest_lock = None
        if self.tree is not None:
            self.tree.close()
            self.tree = None
        for comm in (self._node_comm, self._group_comm):
            if comm is not None:
                comm.Free()
        self._node_comm = self._group_comm = None

    def explain_space(self, outcome: StageOutcome[T], needed: int) -> None:
        """Add what this node needed (``needed``: the bytes of the files it writes) and has free to
        a full-disk error raised while writing."""
        error = outcome.error
        if isinstance(error, LocalFSError) and getattr(error, "no_space", False):
            try:
                free = f"{free_bytes(self.dest)} bytes free"
            except OSError:
                free = "free space unknown"
            error.message += f" ({needed} bytes needed on this node, {free})"

    def warn_direct(self, refused: Sequence[str | None]) -> None:
        """One line on rank 0 (once per run) when some rank's filesystem refused O_DIRECT
        (``refused``: per rank, a path where it did, or None)."""
        where = [(rank, path) for rank, path in enumerate(refused) if path]
        if not where or self._warned_direct:
            return
        self._warned_direct = True
        if self.rank == 0:
            ranks = ", ".join(str(r) for r, _ in where)
            say(
                f"azcp-cluster: warning: the filesystem of DEST refuses O_DIRECT on rank(s) {ranks} "
                f"(e.g. {where[0][1]}): writing through the page cache there"
            )
