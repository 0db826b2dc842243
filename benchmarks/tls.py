"""The download's client over HTTP and HTTPS: CPU-s per GiB and MiB/s, against its ceiling.

    python -m benchmarks.tls [--size 1GiB] [--workers 1,2,4,8] [--repeats 3] [--pin] [--json FILE]

The server is nginx (Debian's ``nginx-light``: ``apt-get install nginx-light``), serving the
same bytes over HTTP and HTTPS with ranged GETs from a throwaway prefix on loopback: a
ceiling that is not the bottleneck (the emulator's own TLS tops out near 0.4 GiB/s here).
For each scheme, in one run, alternating, medians of ``--repeats``:

* ``lean``: a lean aiohttp loop of the same ranged GETs, bodies read and dropped (one
  process): the client CPU Python cannot go below with aiohttp;
* ``tool-1``: the tool's download byte path in one process (``download.Downloader``:
  bodies received into the page-aligned pool, each block's CRC taken as its reads land (a
  real run's journal wants it), written to disk with O_DIRECT);
* ``tool-1-nocrc``: the same without the block CRC (``--no-resume`` without ``--verify``):
  ``crc_cost`` is what the CRC adds to ``tool-1``'s CPU per GiB, measured in the same run;
* ``tool-N``: the same on N worker processes (``workers.WorkerDownloader``, ``--download-workers N``);
* ``tool-1-uvloop``: ``tool-1`` under uvloop's event loop (the 'bench' extra);
* ``blocking-T``: T threads on blocking connections (http.client, ``readinto`` one buffer each,
  bodies dropped): the thread design, whose TLS reads release the GIL.

Kernel TLS is not among them: Python 3.11's ssl module cannot hand a session to the kernel
and this VM's kernel has no ``tls`` module.

Client CPU is the benchmark process's own time plus its waited-for children's (the
workers); ``ratio_cpu`` is the tool's CPU-s per GiB over the lean loop's. On a machine with
few cores the workers share them with nginx: the sweep's MiB/s says more on a many-core one.
``--pin`` puts this process on the first CPU and nginx on the others: on a small machine the
figures of one process then vary far less from run to run (client and server no longer
migrate onto each other's core), which a difference of a few per cent needs. The workers and
the blocking threads then share that one CPU: their rows say nothing of parallelism.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from azcp_cluster.azure.credentials import ANONYMOUS, Authorizer
from azcp_cluster.core.blocks import Block
from azcp_cluster.core.config import Config, MiB, parse_size
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.devtools.azurite import free_port
from azcp_cluster.devtools.certs import make_certificate
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.download.downloader import Downloader
from azcp_cluster.download.fetcher import LandingSink
from azcp_cluster.download.workers import WorkerDownloader
from azcp_cluster.download.writepool import WritePool
from benchmarks.run import _raw_download

GiB = 1 << 30
ACCOUNT, CONTAINER = "devstoreaccount1", "bench"
NGINX_CONF = """
worker_processes {workers};
user root;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{http};
        listen 127.0.0.1:{https} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        root {root};
    }}
}}
"""


def _cpu() -> float:
    """CPU seconds of this process and its waited-for children so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _blocking(urls: list[str], size: int, block: int, threads: int, tls: ssl.SSLContext | None) -> None:
    """``threads`` threads, each on one keep-alive blocking connection (http.client), bodies read
    with ``readinto`` into one preallocated buffer per thread and dropped: the thread design."""
    ranges = [(u, off, min(block, size - off)) for u in urls for off in range(0, size, block)]
    lock = threading.Lock()

    def worker() -> None:
        buf = memoryview(bytearray(block))
        conn: http.client.HTTPConnection | None = None
        while True:
            with lock:
                if not ranges:
                    break
                url, off, length = ranges.pop()
            parts = urlsplit(url)
            if conn is None:
                if parts.scheme == "https":
                    conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, context=tls)
                else:
                    conn = http.client.HTTPConnection(parts.hostname or "", parts.port)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"Range": f"bytes={off}-{off + length - 1}"})
            resp = conn.getresponse()
            got = 0
            while got < length:
                n = resp.readinto(buf[got:length])
                if not n:
                    break
                got += n
            resp.read()
            assert got == length
        if conn is not None:
            conn.close()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def measure(run: Callable[[], None], total: int) -> tuple[float, float]:
    """(MiB/s, client CPU-s per GiB) of one ``run`` that moves ``total`` bytes."""
    cpu, wall = _cpu(), time.perf_counter()
    run()
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    return total / MiB / wall, cpu / (total / GiB)


def uvloop_available() -> bool:
    """Whether uvloop is installed (the 'bench' extra)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def bench_scheme(
    url: str,
    tls: ssl.SSLContext | None,
    work: Path,
    names: list[str],
    size: int,
    cfg: Config,
    sweep: list[int],
    repeats: int,
) -> dict[str, Any]:
    """The lean loop and the tool with each worker count against ``url``, alternating; medians."""
    block = cfg.block_size
    total = size * len(names)
    auth = Authorizer(parse_blob_url(url), ANONYMOUS, time.time)
    urls = [auth.blob_url(n) for n in names]
    files = [FileEntry(name=n, path=n, size=size) for n in names]
    blocks = [Block(i, off, block) for i in range(len(names)) for off in range(0, size, block)]

    def lean() -> None:
        asyncio.run(_raw_download(urls, size, block, cfg.concurrency, tls))

    def blocking(threads: int) -> Callable[[], None]:
        return lambda: _blocking(urls, size, block, threads, tls)

    # The one-process phases' buffers, mapped once before any run is timed, as the pipeline maps
    # them before the stage's clock starts: a pool made in each run cost it its page faults, and
    # the zeroing of fresh pages varied its CPU per GiB two-fold. One pool for all (they never
    # run at once), so that huge or small pages, as the machine had them, are the same for each.
    pool = WritePool(cfg, populate=True)

    def tool(workers: int, loop: str = "asyncio", crc: bool = True) -> Callable[[], None]:
        # A real run hashes every block as it lands (the journal, --verify); crc=False is the
        # client without the block CRC (--no-resume without --verify), for the hash's cost.
        sink = LandingSink(journal=lambda *_: None) if crc else None

        def run() -> None:
            dest = work / "dest"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            tree = DestTree(str(dest))
            tree.prepare_all([(n, size) for n in names])
            try:
                if loop == "uvloop":
                    import uvloop

                    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
                try:
                    if workers == 1:
                        stats = Downloader(files, tree, auth, cfg, sink=sink, pool=pool).run(blocks)
                    else:
                        down = WorkerDownloader(files, str(dest), tree.made, lambda i: names[i], auth, cfg, workers)
                        stats = down.run(blocks)
                finally:
                    asyncio.set_event_loop_policy(None)
                assert stats.bytes == total
            finally:
                tree.close()

        return run

    phases = [("lean", lean), ("blocking-1", blocking(1)), ("blocking-2", blocking(2))]
    if uvloop_available():
        phases.append(("tool-1-uvloop", tool(1, "uvloop")))
    phases += [(f"tool-{w}", tool(w)) for w in sweep]
    if 1 in sweep:
        phases.append(("tool-1-nocrc", tool(1, crc=False)))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in phases}
    for repeat in range(repeats):
        turn = repeat % len(phases)
        for name, phase in phases[turn:] + phases[:turn]:
            samples[name].append(measure(phase, total))
    figures: dict[str, Any] = {}
    for name, got in samples.items():
        figures[name] = {
            "mib_s": round(statistics.median(r for r, _ in got), 1),
            "cpu_s_per_gib": round(statistics.median(c for _, c in got), 3),
        }
    if "tool-1-nocrc" in figures:
        with_crc, without = figures["tool-1"]["cpu_s_per_gib"], figures["tool-1-nocrc"]["cpu_s_per_gib"]
        figures["crc_cost"] = round(with_crc / without - 1, 3)
    lean_cpu = figures["lean"]["cpu_s_per_gib"]
    one = figures["tool-1"]["mib_s"] if "tool-1" in figures else None
    for name, fig in figures.items():
        if not isinstance(fig, dict):
            continue
        fig["ratio_cpu"] = round(fig["cpu_s_per_gib"] / lean_cpu, 3)
        if one and name.startswith("tool-"):
            fig["speedup"] = round(fig["mib_s"] / one, 2)
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print (and with --json write) its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB", help="bytes in all (4 files)")
    parser.add_argument("--workers", default="1,2,4,8", help="the sweep of --download-workers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--block-size", default="16MiB")
    parser.add_argument("--nginx-workers", default="auto")
    parser.add_argument(
        "--pin", action="store_true", help="this process on CPU 0, nginx on the others (one process's figures only)"
    )
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        print("benchmarks.tls: needs nginx (apt-get install nginx-light)", file=sys.stderr)
        return 2
    total, block = parse_size(args.size), parse_size(args.block_size)
    size = total // 4 // block * block
    total = size * 4
    sweep = [int(w) for w in args.workers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="azcp-tls-bench-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        cert, key = make_certificate(work)
        data = work / "root" / ACCOUNT / CONTAINER
        data.mkdir(parents=True)
        names = [f"blob-{i}.bin" for i in range(4)]
        for i, name in enumerate(names):
            (data / name).write_bytes(pseudo_random(size, f"tls{i}"))
        ports = {"http": free_port(), "https": free_port()}
        conf = work / "nginx.conf"
        conf.write_text(
            NGINX_CONF.format(
                workers=args.nginx_workers,
                prefix=work,
                http=ports["http"],
                https=ports["https"],
                cert=cert,
                key=key,
                root=work / "root",
            )
        )
        cpus = sorted(os.sched_getaffinity(0))
        server_cpus = set(cpus[1:]) if args.pin and len(cpus) > 1 else set(cpus)
        if args.pin and len(cpus) > 1:
            os.sched_setaffinity(0, {cpus[0]})  # the workers inherit it
        proc = subprocess.Popen(
            [nginx, "-c", str(conf), "-p", str(work), "-g", "daemon off;"],
            preexec_fn=lambda: os.sched_setaffinity(0, server_cpus),
        )
        time.sleep(1.0)
        # The tool's ssl_context (REQUESTS_CA_BUNDLE first), in this process and the workers.
        os.environ["REQUESTS_CA_BUNDLE"] = os.environ["SSL_CERT_FILE"] = str(cert)
        tls = ssl.create_default_context(cafile=str(cert))
        cfg = Config(source="x", dest="y", block_size=block, concurrency=args.concurrency)
        results: dict[str, Any] = {"bytes": total, "block_size": block, "concurrency": args.concurrency}
        for scheme in ("http", "https"):
            url = f"{scheme}://127.0.0.1:{ports[scheme]}/{ACCOUNT}/{CONTAINER}/"
            results[scheme] = bench_scheme(
                url, tls if scheme == "https" else None, work, names, size, cfg, sweep, args.repeats
            )
        results["cpus"] = len(cpus)
        results["pinned"] = bool(args.pin and len(cpus) > 1)
        print(json.dumps(results, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGQUIT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
