"""Download worker processes: a rank's ranged GETs on several cores (TLS is CPU-bound in Python).

Why processes and not threads: a rank's client spends most of its CPU in Python (the event
loop, asyncio's TLS layer, the protocol) with the GIL held; only OpenSSL's decryption and
the socket reads release it. Threads would share one interpreter's worth of that work;
processes (started fresh with ``python -m azcp_cluster.download.dlworker``, never forked from an
MPI process without an exec) each have their own.

The rank stays the one the cluster talks to. Each worker runs an ordinary
:class:`~azcp_cluster.download.downloader.Downloader` on its part of the rank's blocks, with its own
buffers and writer threads, and reports over a private socket pair: bytes and landed
blocks as they come (the rank passes them to the progress bar and the streaming engine),
then its counters, or its error. The rank sends it what it cannot know alone: a fresh
bearer token (one token cache per rank: the workers never ask the credential themselves,
so no token storm), and "stop" when another rank or another worker failed. When to stop,
whom to kill and why, and which error the run ends with are decided by the pure
:class:`~azcp_cluster.core.supervisor.Supervisor`; :meth:`WorkerDownloader._drive` only reads
the sockets, feeds it what happened and carries out what it says.

Safety is what a non-leader downloader already has: the worker opens DEST by its real path
and writes only into the temporary files whose identities the rank hands it (those its
node's leader made), never through a link. A worker ignores SIGINT and SIGTERM (its rank
decides and tells it) and is killed by the kernel if its rank dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from azcp_cluster.azure.credentials import Authorizer, Credential
from azcp_cluster.azure.proxies import Proxy
from azcp_cluster.core.blocks import SPARE_BUFFERS, Block, deal_requests, requests_for
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import DownloadError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.source import BlobSource
from azcp_cluster.core.supervisor import (
    STOP_GRACE_SECONDS,
    Done,
    Drop,
    Ended,
    Instruction,
    Kill,
    PeerFailure,
    Refresh,
    Said,
    SendToken,
    Supervisor,
    Tell,
    Tick,
    Token,
)
from azcp_cluster.download.fetcher import DownloadStats, Fetcher, LandingSink
from azcp_cluster.run.notices import NOTICES

if TYPE_CHECKING:
    from azcp_cluster.download.cpus import Sample
    from azcp_cluster.download.downloader import Downloader

# How often the rank looks at the other ranks and at its token while its workers run.
TICK_SECONDS = 0.1
# A send to (or a message from) a worker that takes longer than this counts as its end.
SEND_TIMEOUT_SECONDS = 10.0
# A worker says it is alive this often; one that says nothing for its read timeout plus
# SILENCE_MARGIN (frozen, stuck starting on a hung filesystem) ends the run, named.
HEARTBEAT_SECONDS = 1.0  # often enough that a silent worker is noticed in seconds
SILENCE_MARGIN_SECONDS = 10.0  # a busy machine's scheduling and a worker's start fit in it
# What a worker process costs beyond its buffers (an interpreter with numpy), for the memory check.
WORKER_MEMORY = 96 * 1024 * 1024
_FRAME = struct.Struct("!I")
# Where a worker's last message carries its figures (DownloadStats, or None).
_FIGURES_AT = {"done": 1, "stopped": 1, "error": 3}


def send(sock: socket.socket, message: Any) -> None:
    """One message (a pickled tuple) on ``sock``: a length, then the bytes."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_FRAME.pack(len(data)) + data)


def receive(sock: socket.socket) -> Any:
    """The next message on ``sock``; None once the other side has closed it."""
    head = _read_exactly(sock, _FRAME.size)
    if head is None:
        return None
    (length,) = _FRAME.unpack(head)
    data = _read_exactly(sock, length)
    if data is None:
        return None
    return pickle.loads(data)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < n:
        try:
            chunk = sock.recv(n - len(chunks))
        except (ConnectionError, OSError):
            return None
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


@dataclass(frozen=True)
class Job:
    """What one worker is asked to do (sent pickled as its first message)."""

    worker: int
    files: Mapping[int, FileEntry]  # only the files its blocks are in
    blocks: tuple[Block, ...]
    dest: str
    made: Mapping[str, int]  # relative path -> identity of the temporary files it may write
    cfg: Config  # its --concurrency is its part of the rank's
    credential: Credential  # a token credential without its object: tokens come from the rank
    source: BlobSource
    token: tuple[str, float] | None  # the rank's current bearer token and its expiry
    buffers: int  # its download buffers (its part of the rank's pool)
    rate: float | None  # its part of the rank's --max-bandwidth share, bytes per second (its burst: 0.1 s of it)
    proxy: Proxy | None


class _Worker:
    """A worker process and its socket, as the driver handles them (what it did to it: ``done``, ``told``)."""

    __slots__ = ("done", "heard", "index", "proc", "sock", "told")

    def __init__(self, index: int, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.index = index
        self.proc = proc
        self.sock = sock
        self.done = False  # it said its last (or is gone): no longer listened to
        self.told = False  # it was told to stop
        self.heard = time.monotonic()  # when it was started (the supervisor counts its silence from then)


class WorkerDownloader:
    """The downloader interface (:class:`~azcp_cluster.download.fetcher.Fetcher`) over worker processes.

    ``run(blocks)`` returns the summed :class:`DownloadStats` or raises the first worker's
    error (``PeerFailed`` when the rank was told to stop). ``sink`` (told of the workers'
    bytes and landed blocks) and ``peer_failed`` are called on the thread that called
    ``run``, as a Downloader's are.
    """

    def __init__(
        self,
        files: Sequence[FileEntry],
        dest: str,
        made: Mapping[str, int],
        paths: Callable[[int], str],
        auth: Authorizer,
        cfg: Config,
        workers: int,
        *,
        peer_failed: Callable[[], bool] = lambda: False,
        sink: LandingSink | None = None,
        rate: float | None = None,
        proxy: Proxy | None = None,
    ) -> None:
        self.files = files
        self.dest = dest
        self.made = made
        self.paths = paths  # file index -> its path below DEST (the key of ``made``)
        self.auth = auth
        self.cfg = cfg
        self.workers = workers
        self.peer_failed = peer_failed
        self.sink = sink if sink is not None else LandingSink()
        self.rate = rate
        self.proxy = proxy
        self.stats = DownloadStats()

    def run(self, blocks: Sequence[Block]) -> DownloadStats:
        """Download every block on the workers; raise the first failure after all of them ended."""
        requests = len(requests_for(blocks, self.cfg.block_size))
        count = min(self.workers, requests, self.cfg.concurrency)  # each worker has a request or more
        parts = [part for part in deal_requests(blocks, count, self.cfg.block_size) if part] if count else []
        running: list[_Worker] = []
        self.stats.worker_bytes = [0] * len(parts)
        try:
            for index, part in enumerate(parts):
                running.append(self._start(index, part, len(parts)))
            done = self._drive(running)
        finally:
            self._end(running)
        if done.error is not None:
            raise done.error
        if done.stopped:
            from azcp_cluster.run.cluster import PeerFailed

            raise PeerFailed()
        return self.stats

    # -- starting and ending --------------------------------------------------------------

    def _job(self, index: int, part: list[Block], count: int) -> Job:
        """Worker ``index``'s job: its blocks, the files they are in, its part of the rank's
        requests, buffers and pace."""
        needed = {b.file for b in part}
        cred = self.auth.credential
        token = None
        if self.auth.tokens is not None:
            token = self.auth.tokens.get()
            cred = replace(cred, token_credential=None)
        concurrency = max(1, self.cfg.concurrency // count + (1 if index < self.cfg.concurrency % count else 0))
        paths = {i: self.paths(i) for i in needed}
        return Job(
            worker=index,
            files={i: self.files[i] for i in needed},
            blocks=tuple(part),
            dest=self.dest,
            made={p: self.made[p] for p in paths.values() if p in self.made},
            cfg=replace(self.cfg, concurrency=concurrency),
            # The rank's spare buffers are split too: N workers hold what one rank would.
            buffers=min(concurrency + max(1, SPARE_BUFFERS // count), len(part) + max(1, SPARE_BUFFERS // count)),
            credential=cred,
            source=self.auth.source,
            token=token,
            rate=self.rate / count if self.rate is not None else None,
            proxy=self.proxy,
        )

    def _start(self, index: int, part: list[Block], count: int) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        import azcp_cluster

        # The directory holding the package (never the package's own: its azure/ would hide Azure's).
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(azcp_cluster.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        # Blocked while the child starts, so that it inherits them blocked: a Ctrl-C to the
        # process group in the moment before it ignores them cannot kill it (its rank decides).
        held = {signal.SIGINT, signal.SIGTERM}
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "azcp_cluster.download.dlworker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            ours.close()
            raise DownloadError(f"cannot start download worker {index}: {exc.strerror or exc}") from None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            theirs.close()
        # Never blocked for long by a worker that does not read (stopped, or stuck starting):
        # a send or a receive that takes this long counts as the worker's end.
        ours.settimeout(SEND_TIMEOUT_SECONDS)
        worker = _Worker(index, proc, ours)
        with contextlib.suppress(OSError):  # it died, or does not read: its end says so below
            send(ours, ("job", self._job(index, part, count)))
        return worker

    def _end(self, running: list[_Worker]) -> None:
        """Every worker told to stop, given a grace period, then killed; sockets closed."""
        self._tell([w for w in running if not w.done and not w.told], ("stop",))
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for worker in running:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
            worker.sock.close()

    # -- while they run: the driver of core/supervisor.py's machine -----------------------

    def _drive(self, running: list[_Worker]) -> Done:
        """Carry out the supervisor's instructions and feed it what happened, until it says Done."""
        tokens = self.auth.tokens
        machine = Supervisor(
            [w.proc.pid for w in running],
            [w.heard for w in running],
            self.cfg.read_timeout + SILENCE_MARGIN_SECONDS,
            token=tokens.get() if tokens is not None else None,
        )
        with selectors.DefaultSelector() as selector:
            for worker in running:
                selector.register(worker.sock, selectors.EVENT_READ, worker)
            todo = deque(machine.start())
            while True:
                while todo:
                    step = todo.popleft()
                    if isinstance(step, Done):
                        return step
                    todo.extend(self._carry_out(step, running, selector, machine))
                todo.extend(self._turn(selector, machine))

    def _turn(self, selector: selectors.BaseSelector, machine: Supervisor) -> list[Instruction]:
        """One turn: the workers' messages (up to a tick's wait), another rank's failure, the tick."""
        out: list[Instruction] = []
        for key, _ in selector.select(TICK_SECONDS):
            out += self._read(key.data, machine)
        if not machine.stopping and self.peer_failed():
            out += machine.feed(PeerFailure(time.monotonic()))
        return out + machine.feed(Tick(time.monotonic()))

    def _read(self, worker: _Worker, machine: Supervisor) -> list[Instruction]:
        """The next message of a worker whose socket is readable, passed on and told to the machine."""
        at = time.monotonic()
        message = receive(worker.sock)
        if message is not None:
            return machine.feed(self._pass_on(worker, message, at))
        # Its socket closed before its last word. Asked before the wait, as the machine's
        # stop would have been: a peer's failure makes its end a stop, not its own failure.
        peer = not machine.stopping and self.peer_failed()
        code = self._reap(worker)
        at = time.monotonic()
        out = machine.feed(PeerFailure(at)) if peer else []
        return out + machine.feed(Ended(worker.index, code, at))

    def _reap(self, worker: _Worker) -> int:
        """The exit code of a worker whose socket closed (one that lives on is killed after the grace)."""
        try:
            return worker.proc.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:  # closed its socket but lives on: not waited for
            worker.proc.kill()
            return worker.proc.wait()

    def _carry_out(
        self, step: Instruction, running: list[_Worker], selector: selectors.BaseSelector, machine: Supervisor
    ) -> list[Instruction]:
        """Do what ``step`` says; what the machine asks next (after the token cache's answer)."""
        if isinstance(step, Tell):
            self._tell([running[i] for i in step.workers], ("stop",))
        elif isinstance(step, SendToken):
            self._tell([running[i] for i in step.workers], ("token", step.token))
        elif isinstance(step, Kill):
            running[step.worker].proc.kill()
            if step.wait:
                running[step.worker].proc.wait()
        elif isinstance(step, Drop):
            running[step.worker].done = True
            selector.unregister(running[step.worker].sock)
        elif isinstance(step, Refresh):
            assert self.auth.tokens is not None  # asked only where the workers were given a token
            return machine.feed(Token(self.auth.tokens.get()))  # refreshed here when due, once for all workers
        return []

    def _tell(self, workers: list[_Worker], message: Any) -> None:
        for worker in workers:
            if message[0] == "stop":
                worker.told = True  # once: a worker that does not read must not fill its socket
            with contextlib.suppress(OSError):
                send(worker.sock, message)

    def _pass_on(self, worker: _Worker, message: Any, at: float) -> Said:
        """Pass a message's bytes, landed blocks and figures on; what it says, for the machine."""
        kind = message[0]
        if kind == "bytes":
            self.sink.add_bytes(message[1])
        elif kind == "landed":
            self.sink.landed(message[1], message[2])
        elif kind == "retrying":  # a retry notice: said by the rank, in its own rhythm
            NOTICES.retrying(*message[1:])
        elif kind in _FIGURES_AT:
            at_index = _FIGURES_AT[kind]
            self._add(worker, message[at_index] if len(message) > at_index else None)
        if kind != "error":
            return Said(worker.index, kind, at)
        from azcp_cluster.run.cluster import error_from_payload

        error = error_from_payload(message[1])
        if len(message) > 2 and message[2]:
            error.no_space = True  # type: ignore[attr-defined]
        return Said(worker.index, kind, at, error)

    def _add(self, worker: _Worker, stats: DownloadStats | None) -> None:
        """A worker's figures into the rank's (also a failed or stopped one's: the report has what it did)."""
        if stats is None:
            return
        self.stats.bytes += stats.bytes
        self.stats.requests += stats.requests
        self.stats.retries += stats.retries
        self.stats.retry_causes.update(stats.retry_causes)
        self.stats.direct_refused = self.stats.direct_refused or stats.direct_refused
        self.stats.worker_bytes[worker.index] = stats.bytes


# A part of an auto download: the rank's own Downloader, then its worker processes.
_Part = TypeVar("_Part", bound=Fetcher)

# Auto: the rank downloads alone for at least this long and this many bytes before it judges.
PROBE_SECONDS = 0.5  # long enough for the connections to reach their rate
PROBE_BYTES = 32 * 1024 * 1024  # enough bytes that a rate is a rate, not the first request's latency


class AutoDownloader:
    """``--download-workers auto``: the rank downloads alone, measures, and hands the rest of its
    blocks to worker processes only where they shorten the copy (:func:`topology.handover_workers`).

    After :data:`PROBE_SECONDS` and :data:`PROBE_BYTES` it reads its rate, the cores it kept busy and
    the idle cores among those it may use (:mod:`azcp_cluster.download.cpus`), once. Workers that pay take
    the blocks no request has started; the rank's own requests in flight end first. The same
    interface (:class:`~azcp_cluster.download.fetcher.Fetcher`) as its parts, which ``alone`` and
    ``processes`` make with the stage's landing sink and ``peer_failed``: they are called on
    the thread that runs it.
    """

    def __init__(
        self,
        alone: Callable[[Callable[[], bool | None]], Downloader],
        processes: Callable[[int], WorkerDownloader],
        most: int,
        sharing: int,
        *,
        release: Callable[[], None] = lambda: None,
        cpus: list[int] | None = None,
        sampler: Callable[[list[int]], Sample] | None = None,
    ) -> None:
        from azcp_cluster.download import cpus as cpu_info

        self._alone = alone  # handover -> the rank's own Downloader
        self._processes = processes  # count -> a WorkerDownloader
        self.most = most
        self.sharing = sharing
        self._release = release  # the rank's own download buffers, once it hands over
        self._cpus = cpu_info.allowed() if cpus is None else cpus
        self._sample = sampler or cpu_info.sample
        self.workers = 0  # decided: how many took over (0: none)
        self.measured: tuple[float, float, float | None] | None = None  # rate, own cores, idle cores
        self._parts: list[DownloadStats] = []  # the live stats of each part that ran, in order
        self._first: Downloader | None = None
        self._start: Sample | None = None
        self._total = 0

    @property
    def stats(self) -> DownloadStats:
        """What the rank and its workers fetched so far (live, also after a failure)."""
        total = DownloadStats()
        for part in self._parts:
            total.bytes += part.bytes
            total.requests += part.requests
            total.retries += part.retries
            total.retry_causes.update(part.retry_causes)
            total.direct_refused = total.direct_refused or part.direct_refused
            total.worker_bytes += part.worker_bytes
        return total

    def run(self, blocks: Sequence[Block]) -> DownloadStats:
        """Download every block: alone, then (if they pay) the rest on workers."""
        self._total = sum(b.length for b in blocks)
        first = self._counted(self._alone(self._judge))
        self._first = first
        self._start = self._sample(self._cpus)
        try:
            first.run(blocks)
        finally:
            self._first = None  # its buffers are freed with it
        if first.left:
            left = first.left
            del first  # its buffers are freed with it
            self._release()  # the workers map buffers of their own: the rank's go first
            self._counted(self._processes(self.workers)).run(left)
        return self.stats

    def _counted(self, part: _Part) -> _Part:
        """``part``, its live figures counted in the rank's."""
        self._parts.append(part.stats)
        return part

    def _judge(self) -> bool | None:
        """Called at the rank's watchdog ticks until it answers: True hands the rest over, False keeps it."""
        from azcp_cluster.core.topology import handover_workers
        from azcp_cluster.download import cpus as cpu_info

        now = self._sample(self._cpus)
        assert self._first is not None and self._start is not None  # asked only while the rank runs alone
        got = self._first.received
        if now.wall - self._start.wall < PROBE_SECONDS or got < PROBE_BYTES:
            return None
        own, idle = cpu_info.busy(self._start, now)
        rate = got / (now.wall - self._start.wall)
        self.measured = (rate, own, idle)
        self.workers = handover_workers(self._total - got, rate, own, idle, self.sharing, self.most)
        return self.workers > 0
