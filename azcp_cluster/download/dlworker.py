"""One download worker process: ``python -m azcp_cluster.download.dlworker FD`` (started by workers.py).

It reads its :class:`~azcp_cluster.download.workers.Job` from the socket ``FD``, runs a
:class:`~azcp_cluster.download.downloader.Downloader` on its blocks, and reports on the same socket:
``("bytes", n)`` and ``("landed", block, crc)`` as blocks complete, then ``("done", stats)``,
``("error", payload, no_space, stats)`` or ``("stopped", stats)`` (its figures so far, or
None). From the rank it takes ``("token", (token, expires_on))`` and ``("stop",)``; the
rank's end (its socket closing) stops it too.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from azcp_cluster.download.fetcher import DownloadStats
    from azcp_cluster.download.workers import Job

PR_SET_PDEATHSIG = 1


class _PushedToken:
    """A token credential whose tokens come from the rank (workers never ask the real one)."""

    def __init__(self, token: tuple[str, float] | None) -> None:
        self.lock = threading.Lock()
        self.token = token

    def update(self, token: tuple[str, float]) -> None:
        with self.lock:
            self.token = token

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        with self.lock:
            token = self.token
        if token is None:
            raise RuntimeError("no token from the rank")
        return AccessToken(token[0], int(token[1]))


def _die_with_parent() -> None:
    """Ask the kernel to kill this process when the rank that started it dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    """Run one job; the exit status is 0 whatever happened (the socket carries the outcome)."""
    # The rank decides what a signal means and tells its workers; a worker never dies of one
    # on its own (a Ctrl-C reaches the whole process group) and never prints a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    from azcp_cluster.download.workers import HEARTBEAT_SECONDS, receive, send

    sock = socket.socket(fileno=int(argv[1]))
    first = receive(sock)
    if first is None or first[0] != "job":
        return 0
    job = first[1]
    lock = threading.Lock()

    def say(message: tuple[Any, ...]) -> None:
        with lock:
            try:
                send(sock, message)
            except OSError:
                stop.set()  # the rank is gone

    stop = threading.Event()
    pushed = _PushedToken(job.token)

    def listen() -> None:
        while True:
            message = receive(sock)
            if message is None or message[0] == "stop":
                stop.set()
                return
            if message[0] == "token":
                pushed.update(message[1])

    def beat() -> None:
        # The rank tells a slow worker from a frozen one by these (see workers.HEARTBEAT_SECONDS).
        while not stop.wait(HEARTBEAT_SECONDS):
            say(("alive",))

    threading.Thread(target=listen, name="azcp-worker-listen", daemon=True).start()
    threading.Thread(target=beat, name="azcp-worker-beat", daemon=True).start()
    seen: list[DownloadStats] = []  # the downloader's DownloadStats once made: its figures also go with a failure
    try:
        stats = run(job, pushed, stop, say, seen)
        say(("stopped", seen[0]) if stats is None else ("done", stats))
    except BaseException as exc:  # everything reaches the rank as one error
        from azcp_cluster.run.cluster import PeerFailed, as_azcp_error, error_payload

        figures = seen[0] if seen else None
        if isinstance(exc, PeerFailed) or stop.is_set():
            say(("stopped", figures))
        else:
            error = as_azcp_error(exc, rank=None)  # type: ignore[arg-type]
            # A full disk keeps its mark: the rank adds what this node needed and had free.
            say(("error", error_payload(error), bool(getattr(error, "no_space", False)), figures))
    with lock:
        sock.close()
    return 0


def run(
    job: Job,
    pushed: _PushedToken,
    stop: threading.Event,
    say: Callable[[tuple[Any, ...]], None],
    seen: list[DownloadStats],
) -> DownloadStats | None:
    """Download the job's blocks: their DownloadStats, or None if it was stopped before the end.

    The downloader's live DownloadStats go into ``seen`` as soon as it is made.
    """
    from dataclasses import replace

    from azcp_cluster.azure.credentials import Authorizer
    from azcp_cluster.core.throttle import Pacer
    from azcp_cluster.dest.desttree import DestTree
    from azcp_cluster.download.downloader import Downloader
    from azcp_cluster.download.fetcher import LandingSink

    credential = job.credential
    if credential.kind == "token":
        credential = replace(credential, token_credential=pushed)
    auth = Authorizer(job.source, credential, time.time)
    from azcp_cluster.dest.nodewriter import NodeWriter
    from azcp_cluster.download.writepool import WRITER_THREADS, WritePool

    tree = DestTree(job.dest, create=False)
    tree.adopt(dict(job.made))
    pacer = Pacer.for_rate(job.rate, time.monotonic) if job.rate else None
    writer = NodeWriter(job.files, tree, WRITER_THREADS)  # no journal: the rank's sink records
    try:
        downloader = Downloader(
            job.files,
            tree,
            auth,
            job.cfg,
            peer_failed=stop.is_set,
            # Everything goes to the rank, which tells its own sink (journal, streaming, progress).
            sink=LandingSink(
                progress=lambda n: say(("bytes", n)), report=lambda block, crc: say(("landed", block, crc))
            ),
            pacer=pacer,
            pool=WritePool(job.cfg, populate=True, buffers=job.buffers),
            writer=writer,
            proxy=job.proxy,
            # Its retries are said by the rank (one rhythm for the rank and all its workers).
            notify=lambda *retry: say(("retrying", *retry)),
        )
        seen.append(downloader.stats)
        stats = downloader.run(list(job.blocks))
    finally:
        writer.close()
        tree.close()
    if stop.is_set() and stats.bytes < sum(b.length for b in job.blocks):
        return None
    return stats


if __name__ == "__main__":
    sys.exit(main(sys.argv))
