"""What the cluster box's shared parts can do for many small files, measured in the run that uses them.

A checkpoint is one large file and about 1,600 small ones. In the box, two parts that every host
shares bind the small ones before any link does, and neither is a link:

* the emulator's **request rate**: it is one Node.js process on this machine's cores, and a small
  blob costs it a request whatever its size (:func:`request_seconds`: every host at once GETs its
  1/N of the small blobs, the tool's requests per host in flight, through its frontend link);
* the disk's **file-creation rate**: every host's DEST is on this machine's one disk, which makes
  N times the small files (:func:`create_seconds`: every host at once makes the small files in
  its DEST the tool's way: a temporary name made anew, the bytes, the rename; one ``syncfs`` at the
  end, as the tool does from many files on).

Each is a part of the case's bound (benchmarks/cluster.py ``bounds``), like the links' and the disk's
bytes. ``python -m benchmarks.boxprobes get URL SAS CONCURRENCY AT NAME...`` is the GET probe a host
runs in its namespace (prints ``{"requests": n, "start": t0, "end": t1}``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from urllib.parse import quote, urlsplit

from azcp_cluster.dest.localfs import syncfs, temp_name
from azcp_cluster.devtools.box import Box

SMALL = 1 << 20  # a file under this is a small one: its request and its inode cost more than its bytes


def small_files(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """The files of a dataset that count by number rather than by bytes."""
    return {name: data for name, data in files.items() if len(data) < SMALL}


def shares(names: Sequence[str], hosts: int) -> list[list[str]]:
    """``names`` dealt across ``hosts`` hosts, as the tool's plan spreads small files (1/N each)."""
    return [list(names[h::hosts]) for h in range(hosts)]


def get_all(base: str, sas: str, concurrency: int, names: Sequence[str], at: float = 0.0) -> dict[str, float]:
    """GET every blob of ``names`` under ``base`` (``http://host:port/account/container``) with
    ``concurrency`` keep-alive connections (threads: http.client releases the GIL on the socket),
    from the wall-clock time ``at`` on (every host's probe starts together, its own start-up not
    counted); the bodies read and dropped. Returns the wall-clock ``start`` and ``end``. Raises
    RuntimeError on any answer other than 200."""
    parts = urlsplit(base)
    work: queue.SimpleQueue[str] = queue.SimpleQueue()
    for name in names:
        work.put(name)
    errors: list[str] = []
    conns = [
        http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=60)
        for _ in range(max(1, min(concurrency, len(names))))
    ]

    def worker(conn: http.client.HTTPConnection) -> None:
        try:
            while not errors:
                try:
                    name = work.get_nowait()
                except queue.Empty:
                    return
                conn.request("GET", f"{parts.path}/{quote(name, safe='/~')}?{sas}")
                answer = conn.getresponse()
                answer.read()
                if answer.status != 200:
                    errors.append(f"{name}: HTTP {answer.status}")
        except OSError as exc:
            errors.append(repr(exc))
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(conn,)) for conn in conns]
    time.sleep(max(0.0, at - time.time()))
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.time()
    if errors:
        raise RuntimeError(f"GET probe: {errors[0]}")
    return {"requests": len(names), "start": start, "end": end}


LEAD = 2.0  # seconds the probes are given to start before they begin together


def request_seconds(bx: Box, base: str, sas: str, names: Sequence[str], concurrency: int, env: dict[str, str]) -> float:
    """Seconds for every host at once to GET its share of ``names`` (``concurrency`` in flight per
    host) from the emulator at ``base``: the time the emulator's request rate allows the small
    files, from the first host's start to the last one's end (a probe per host, in its namespace,
    all starting at one wall-clock time: their interpreters' start-up is not counted)."""
    repo = Path(__file__).resolve().parents[1]
    at = time.time() + LEAD
    procs = []
    for host, mine in zip(bx.hosts, shares(names, len(bx.hosts)), strict=False):
        argv = [sys.executable, "-m", "benchmarks.boxprobes", "get", base, sas, str(concurrency), str(at), *mine]
        cmd = [str(bx.dir / "nsexec"), host.name, shlex.join(argv)]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    spans = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"GET probe: exit {proc.returncode}\n{err[-2000:]}")
        spans.append(json.loads(out))
    if min(span["start"] for span in spans) > at + 0.5:
        raise RuntimeError("GET probe: a host started late (give the probes more LEAD)")
    return max(span["end"] for span in spans) - min(span["start"] for span in spans)


Job = Callable[[Callable[[], None]], None]  # a host's work: its set-up, ``ready()``, then what is timed


def at_once(jobs: Sequence[Job], what: str, then: Callable[[], None] = lambda: None) -> float:
    """Run every job on a thread of its own, all at once: each sets up, calls the ``ready`` it is
    given, then does the timed work. Returns the seconds from when every job was ready to when
    the last ended and ``then`` (untimed set-up excluded) returned. A job's failure, once every
    thread ended, is raised as a RuntimeError naming ``what`` (the others then found the
    barrier broken)."""
    barrier = threading.Barrier(len(jobs) + 1)
    errors: list[BaseException] = []

    def run(job: Job) -> None:
        try:
            job(barrier.wait)
        except BaseException as exc:  # raised by the caller, once every job ended
            errors.append(exc)
            barrier.abort()  # nobody waits for a job that will not come

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    try:
        for t in threads:
            t.start()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()
        began = time.perf_counter()
        for t in threads:
            t.join()
        if not errors:
            then()
        seconds = time.perf_counter() - began
    finally:
        barrier.abort()
        for t in threads:
            if t.ident is not None:
                t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise RuntimeError(f"{what}: {first!r}") from first
    return seconds


def create_seconds(bx: Box, files: Mapping[str, bytes]) -> float:
    """Seconds for every host at once to make ``files`` in a fresh directory beside its DEST, the
    tool's way (a temporary name made anew, the bytes, a rename), then one ``syncfs``: what the
    box's one disk allows the small files. What it made is removed."""
    roots = [bx.dest_of(host).parent / f".files-{host.name}" for host in bx.hosts]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

    def maker(root: Path) -> Job:
        def make(ready: Callable[[], None]) -> None:
            root.mkdir(parents=True)
            for folder in sorted({str(root / name).rpartition("/")[0] for name in files}):
                os.makedirs(folder, exist_ok=True)
            ready()
            for name, data in files.items():
                final = root / name
                temp = final.parent / temp_name(final.name)
                fd = os.open(temp, flags, 0o600)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                os.rename(temp, final)

        return make

    def sync() -> None:
        fd = os.open(roots[0], os.O_RDONLY | os.O_DIRECTORY)
        try:
            if not syncfs(fd):
                os.sync()
        finally:
            os.close(fd)

    try:
        return at_once([maker(root) for root in roots], "making the small files", sync)
    finally:
        for root in roots:
            subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)


def main(argv: list[str]) -> int:
    """``get BASE SAS CONCURRENCY AT NAME...``: the GET probe a host runs in its namespace."""
    if len(argv) < 5 or argv[0] != "get":
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(get_all(argv[1], argv[2], int(argv[3]), argv[5:], float(argv[4]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
