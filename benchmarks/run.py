"""Benchmarks: each stage of the tool against its ceiling measured in the same run.

    python benchmarks/run.py --quick --json bench.json

download: the tool's download, to durable bytes (``mpiexec -n 1 azcp-cluster``, from its
JSON report's timeline: the download stage's start to the sync stage's end) against the raw
parts it is made of, measured in the same run: the network (a lean aiohttp loop of the same
ranged GETs, same blobs, block size and concurrency, bodies read and dropped, on the same
emulator) and the disk (the same bytes written with O_DIRECT into files created as the tool
creates them, in the tool's write size, then an ``fdatasync`` of each). The tool does both,
so its ``ceiling`` is the slower of the two alone; ``ratio_network`` is against the network
alone, and the two run at once are reported too. The download stage alone (``stage``), the
figure of earlier rounds, is reported beside it: where the tool makes its bytes durable
(during the stage or after it) moves that one and not the durable one. Runs alternate (the order turning
each repeat, with a sync before each phase that writes) and the median of each is kept.
Writes ``{"download": {"value", "ceiling", "ratio", "stage", ...}, ...}`` (MiB/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from yarl import URL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from azcp_cluster.azure.credentials import Authorizer, resolve_credential
from azcp_cluster.core.blocks import BUFFER_BYTES
from azcp_cluster.core.config import Config, MiB, parse_size
from azcp_cluster.core.source import API_VERSION, parse_blob_url
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import aligned_buffer
from azcp_cluster.dest.localfs import temp_path
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.download.writepool import WRITER_THREADS

CONTAINER = "bench"


def mpiexec() -> str:
    """The mpiexec next to this interpreter, else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


async def _raw_download(
    urls: list[str], size: int, block: int, concurrency: int, tls: ssl.SSLContext | None = None
) -> float:
    """Seconds for a lean loop of ranged GETs over ``urls`` (bodies read, then dropped; ``tls``
    for https URLs signed by a private CA)."""
    ranges = [(u, off, min(block, size - off)) for u in urls for off in range(0, size, block)]
    queue: asyncio.Queue[tuple[str, int, int]] = asyncio.Queue()
    for item in ranges:
        queue.put_nowait(item)
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, ssl=tls if tls is not None else True)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            url, off, length = queue.get_nowait()
            headers = {"Range": f"bytes={off}-{off + length - 1}", "x-ms-version": API_VERSION}
            async with session.get(URL(url, encoded=True), headers=headers) as resp:
                resp.raise_for_status()
                got = 0
                while True:
                    piece = await resp.content.readany()
                    if not piece:
                        break
                    got += len(piece)
                assert got == length

    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(ranges)))))
        return time.perf_counter() - started


def _fresh_files(work: Path, files: int, size: int) -> list[int]:
    """Create ``files`` files of ``size`` bytes as the tool creates its temporary files; O_DIRECT descriptors."""
    dest = work / "disk"
    shutil.rmtree(dest, ignore_errors=True)
    names = [f"f{i}" for i in range(files)]
    dest.mkdir(parents=True)
    tree = DestTree(str(dest))
    tree.prepare_all([(name, size) for name in names])
    tree.close()
    return [os.open(temp_path(str(dest), n), os.O_WRONLY | os.O_DIRECT) for n in names]


def _quiesce() -> None:
    """Flush what earlier phases wrote (the guest's caches, and the device's behind it) before timing another."""
    os.sync()


def _raw_write(fds: list[int], size: int, write: int, threads: int) -> float:
    """Seconds to write every file of ``fds`` whole with O_DIRECT, ``write`` bytes a call, on
    ``threads`` threads, and make them durable (an ``fdatasync`` each, 8 at a time, as the
    tool's sync stage does for a few files: an O_DIRECT write has reached the device, but
    neither the device's cache nor the extents it filled are durable before it). The buffer
    is page-aligned and mapped up front. Closes ``fds``.
    """
    buf = aligned_buffer(write, populate=True)
    buf[:] = np.frombuffer(os.urandom(write), dtype=np.uint8)
    jobs = [(fd, off) for fd in fds for off in range(0, size, write)]
    lock = threading.Lock()

    def writer() -> None:
        while True:
            with lock:
                if not jobs:
                    return
                fd, off = jobs.pop()
            os.pwrite(fd, buf[: min(write, size - off)].data, off)

    try:
        started = time.perf_counter()
        pool = [threading.Thread(target=writer) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        with ThreadPoolExecutor(max_workers=8) as syncs:
            list(syncs.map(os.fdatasync, fds))
        return time.perf_counter() - started
    finally:
        for fd in fds:
            os.close(fd)


def _raw_together(
    urls: list[str], size: int, block: int, concurrency: int, fds: list[int], write: int, threads: int
) -> tuple[float, float]:
    """Seconds of the raw GETs and of the raw writes (same bytes), run at the same time."""
    took: dict[str, float] = {}
    disk = threading.Thread(target=lambda: took.setdefault("disk", _raw_write(fds, size, write, threads)))
    disk.start()
    try:
        network = asyncio.run(_raw_download(urls, size, block, concurrency))
    finally:
        disk.join()
    return network, took["disk"]


def _tool_download(source: str, dest: Path, env: dict[str, str], ranks: int, extra: list[str]) -> dict[str, Any]:
    """Run the tool under mpiexec and return its JSON report."""
    report = dest.parent / "report.json"
    cmd = [
        mpiexec(),
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "azcp_cluster",
        source,
        str(dest),
        "--compare",
        "none",
        "--no-progress",
        "--json",
        str(report),
        *extra,
    ]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    doc: dict[str, Any] = json.loads(report.read_text())
    return doc


def durable_seconds(report: dict[str, Any]) -> float:
    """Seconds from the download stage's start to the sync stage's end, rank 0's, from a tool
    report's timeline: the download to durable bytes, wherever the tool made them durable."""
    spans = {entry["stage"]: entry for entry in report["timeline"]}
    return float(spans["sync"]["end"][0] - spans["download"]["start"][0])


def bench_download(
    emu: azurite.Emulator, blob_size: int, blobs: int, repeats: int, block: int, concurrency: int
) -> dict[str, Any]:
    """The tool's download, to durable bytes, against the raw parts it is made of, alternating runs, medians.

    The tool receives every byte and writes it to disk, durably (``durable_seconds``). Its
    ceiling is the slower of the two raw parts, each measured alone: ``network``, a lean
    aiohttp loop of the same ranged GETs (bodies dropped), the issue's ceiling; and ``disk``,
    raw O_DIRECT writes of the same bytes into files created as the tool creates them, in
    the tool's write size, each file then synced (the faster of one thread and the tool's
    count). ``stage`` is the download stage alone, against the same ceiling (``stage_ratio``).
    ``ratio_network`` is the value against the network alone. Also measured, to explain the
    gap: the two raw parts run at once (``network_together``, ``disk_together``); on this
    kind of machine they slow each other down (the disk's and the loopback's traffic share
    one core and the hypervisor).
    """
    names = {f"dl/blob-{i:03d}.bin": pseudo_random(blob_size, f"bench{i}") for i in range(blobs)}
    azurite.upload(emu, CONTAINER, names)
    total = blob_size * blobs
    source = emu.url(CONTAINER, "dl")
    parsed = parse_blob_url(source)
    auth = Authorizer(parsed, resolve_credential(parsed, emu.key_env()), time.time)
    urls = [auth.blob_url(n) for n in names]
    env = {**os.environ, **emu.key_env()}
    extra = ["--block-size", str(block), "--concurrency", str(concurrency), "--shard-size", "1TiB"]
    samples: dict[str, list[float]] = {
        k: [] for k in ("tool", "stage", "network", "disk", "network_together", "disk_together")
    }
    write = BUFFER_BYTES

    def rate(seconds: float) -> float:
        return total / MiB / seconds

    work = Path(tempfile.mkdtemp(prefix="azcp-bench-"))
    try:

        def network_alone() -> None:
            samples["network"].append(rate(asyncio.run(_raw_download(urls, blob_size, block, concurrency))))

        def disk_alone() -> None:
            alone = []
            for threads in (1, WRITER_THREADS):
                fds = _fresh_files(work, blobs, blob_size)
                _quiesce()
                alone.append(_raw_write(fds, blob_size, write, threads))
            samples["disk"].append(rate(min(alone)))

        def together() -> None:
            fds = _fresh_files(work, blobs, blob_size)
            _quiesce()
            net, disk = _raw_together(urls, blob_size, block, concurrency, fds, write, WRITER_THREADS)
            samples["network_together"].append(rate(net))
            samples["disk_together"].append(rate(disk))

        def tool() -> None:
            _quiesce()
            doc = _tool_download(source, work / "dest", env, 1, extra)
            assert doc["downloaded_bytes"] == total
            samples["tool"].append(rate(durable_seconds(doc)))
            samples["stage"].append(rate(doc["stages"]["download"]["seconds"]))
            shutil.rmtree(work / "dest", ignore_errors=True)

        # The order turns from one repeat to the next: a phase that writes leaves the disk
        # (and the hypervisor's cache behind it) busier for whatever comes after it.
        phases = [network_alone, disk_alone, together, tool]
        for i in range(repeats):
            for phase in phases[i % len(phases) :] + phases[: i % len(phases)]:
                phase()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    value = med["tool"]
    ceiling = min(med["network"], med["disk"])
    return {
        "value": round(value, 1),
        "ceiling": round(ceiling, 1),
        "ratio": round(value / ceiling, 3),
        "stage": round(med["stage"], 1),
        "stage_ratio": round(med["stage"] / ceiling, 3),
        "network": round(med["network"], 1),
        "disk": round(med["disk"], 1),
        "network_together": round(med["network_together"], 1),
        "disk_together": round(med["disk_together"], 1),
        "ratio_network": round(value / med["network"], 3),
        "unit": "MiB/s",
        "bytes": total,
        "samples": {k: [round(x, 1) for x in v] for k, v in samples.items()},
        "settings": {
            "block_size": block,
            "concurrency": concurrency,
            "ranks": 1,
            "blobs": blobs,
            "disk_write": write,
            "writer_threads": WRITER_THREADS,
        },
    }


def _bcast_args(chunk: int | None, pipeline: int, writers: int, direct: bool, fanout: str | None = None) -> list[str]:
    """Tool options for one broadcast setting (whole files: no range shards); ``chunk`` and
    ``fanout`` None: the tool's defaults."""
    extra = ["--bcast-pipeline", str(pipeline), "--bcast-writers", str(writers)]
    extra += ["--bcast-chunk", str(chunk)] if chunk is not None else []
    extra += ["--fanout", fanout] if fanout is not None else []
    return extra + ["--shard-size", "1TiB"] + ([] if direct else ["--no-bcast-direct"])


def _span(report: dict[str, Any], first: str, last: tuple[str, ...]) -> float:
    """Seconds from the earliest rank's start of stage ``first`` to the latest rank's end of the first of
    the stages ``last`` the report has (a streamed copy's fan-out is its ``transfer`` stage, a two-phase
    one's ``bcast``), from the report's timeline and each rank's origin (its run's start, Unix time)."""
    spans = {entry["stage"]: entry for entry in report["timeline"]}
    origins = report["timeline_origin"]
    end = next(spans[name] for name in last if name in spans)
    start = min(o + s for o, s in zip(origins, spans[first]["start"], strict=True))
    return float(max(o + e for o, e in zip(origins, end["end"], strict=True)) - start)


def _raw_ceiling(ranks: int, total: int, chunk: int | None, work: Path) -> dict[str, float]:
    """``benchmarks/raw_bcast.py`` on ``ranks`` ranks: raw MPI_Bcast and raw O_DIRECT writes of ``total`` bytes."""
    raw_json = work / "raw.json"
    script = str(Path(__file__).with_name("raw_bcast.py"))
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, script, "--bytes", str(total)]
    cmd += ["--chunk", str(chunk or 64 * MiB), "--dir", str(work), "--json", str(raw_json)]
    subprocess.run(cmd, check=True)
    raw: dict[str, float] = json.loads(raw_json.read_text())
    return raw


def _bcast_repeat(source: str, env: dict[str, str], work: Path, ranks: int, extra: list[str]) -> dict[str, Any]:
    """One repeat of the broadcast case: the copy two-phase (``--no-overlap``: the download, then the
    fan-out alone) and streamed (the default), each into fresh DESTs, then the raw ceiling."""
    sample: dict[str, Any] = {}
    for mode, more in (("two_phase", ["--no-overlap"]), ("streamed", [])):
        doc = _tool_download(source, work / "{rank}", env, ranks, extra + more)
        sample[mode] = {
            "download_s": doc["stages"]["download"]["seconds"],
            "bcast_s": doc["stages"]["bcast"]["seconds"],
            "span_s": _span(doc, "download", ("transfer", "bcast")),  # the download's start to the fan-out's end
            "bytes": doc["broadcast_bytes"],
            "rss": doc["peak_rss_bytes"],
        }
        for r in range(ranks):
            shutil.rmtree(work / str(r), ignore_errors=True)
    sample["raw"] = _raw_ceiling(ranks, sample["two_phase"]["bytes"], _chunk_of(extra), work)
    return sample


def _chunk_of(extra: list[str]) -> int | None:
    """The ``--bcast-chunk`` among the tool options ``extra`` (None: the tool's default)."""
    return int(extra[extra.index("--bcast-chunk") + 1]) if "--bcast-chunk" in extra else None


def _bcast_figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of a size's repeats: the fan-out alone against the raw ceiling, the streamed copy
    against its own bound, and the streamed copy's bcast stage (the figure of earlier rounds)."""
    total = samples[0]["two_phase"]["bytes"]
    fanout = [total / MiB / s["two_phase"]["bcast_s"] for s in samples]
    ceiling = [min(s["raw"]["bcast"], s["raw"]["write"]) for s in samples]
    streamed = [total / MiB / s["streamed"]["span_s"] for s in samples]
    # The streamed copy cannot beat the slower of its two parts done alone (same repeat, two-phase run).
    bound = [total / MiB / max(s["two_phase"]["download_s"], s["two_phase"]["bcast_s"]) for s in samples]
    stage = [total / MiB / s["streamed"]["bcast_s"] for s in samples]
    value, ceil, stream, bnd = (statistics.median(x) for x in (fanout, ceiling, streamed, bound))
    return {
        "bytes": total,
        "value": round(value, 1),
        "ceiling": round(ceil, 1),
        "ratio": round(value / ceil, 3),
        "streamed": {"value": round(stream, 1), "bound": round(bnd, 1), "ratio": round(stream / bnd, 3)},
        "streamed_bcast_stage": round(statistics.median(stage), 1),
        "peak_rss_mib": round(max(s[m]["rss"] for s in samples for m in ("two_phase", "streamed")) / MiB, 1),
        "samples": {
            "fanout": [round(x, 1) for x in fanout],
            "ceiling": [round(x, 1) for x in ceiling],
            "streamed": [round(x, 1) for x in streamed],
            "bound": [round(x, 1) for x in bound],
        },
        "raw_samples": [s["raw"] for s in samples],
    }


def bench_bcast(
    emu: azurite.Emulator,
    prefix: str,
    sizes: dict[str, list[str]],
    ranks: int,
    repeats: int,
    chunk: int | None,
    pipeline: int,
    writers: int,
    direct: bool = True,
    fanout: str | None = None,
) -> dict[str, Any]:
    """The broadcast per receiver, per dataset size, two ways, each against its own bound (MiB/s).

    - ``value``/``ceiling``/``ratio``: the fan-out alone, the ``bcast`` stage of a two-phase copy
      (``--no-overlap``: it starts once the download is done), against min(raw ``MPI_Bcast``, raw
      O_DIRECT write) from ``benchmarks/raw_bcast.py`` on the same ranks in the same repeat.
    - ``streamed``: the default copy, where the fan-out sends blocks as they arrive, from the
      download's start to the fan-out's end (the first rank to start, the last to end), against its ``bound``: the bytes
      over the slower of the download and the fan-out each alone (the two-phase run's stages, same
      repeat), which a perfectly overlapped copy would take. Its ``bcast`` stage alone also waits for
      the download, so bytes over it (``streamed_bcast_stage``, the figure of earlier rounds) is
      neither the fan-out's speed nor the copy's.

    ``chunk``/``fanout`` None: the tool's defaults; the raw ceiling then moves and writes 64 MiB
    pieces (the fastest of the sweep's settings here)."""
    used = Config(source="bench", dest="bench", bcast_chunk=chunk, fanout=fanout or "auto").chunk
    source = emu.url(CONTAINER, prefix)
    env = {**os.environ, **emu.key_env()}
    settings = {"ranks": ranks, "bcast_chunk": used, "fanout": fanout or "auto", "bcast_pipeline": pipeline}
    out: dict[str, Any] = {"settings": {**settings, "bcast_writers": writers, "direct": direct}}
    for label, includes in sizes.items():
        extra = _bcast_args(chunk, pipeline, writers, direct, fanout)
        for pattern in includes:
            extra += ["--include", pattern]
        work = Path(tempfile.mkdtemp(prefix="azcp-bench-bcast-"))
        try:
            samples = [_bcast_repeat(source, env, work, ranks, extra) for _ in range(repeats)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out[label] = _bcast_figures(samples)
        out[label]["rss_budget_mib"] = round((pipeline * used) / MiB + 256, 1)
    return out


def _raw_hash(paths: list[Path], threads: int, direct: bool) -> float:
    """Seconds to read ``paths`` (O_DIRECT where ``direct``) and MD5 them, ``threads`` files at once:
    what ``--verify`` (disk) does after the copy, without the tool around it."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from azcp_cluster.dest.directio import aligned_buffer

    def digest(path: Path) -> str:
        buf = aligned_buffer(8 * MiB)
        md5 = hashlib.md5(usedforsecurity=False)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            offset = 0
            while True:
                got = os.preadv(fd, [memoryview(buf)], offset)  # type: ignore[arg-type]
                md5.update(memoryview(buf[:got]))  # type: ignore[arg-type]
                offset += got
                if got < len(buf):
                    return md5.hexdigest()
        finally:
            os.close(fd)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(digest, paths))
    return time.perf_counter() - started


def bench_verify(emu: azurite.Emulator, prefix: str, ranks: int, repeats: int) -> dict[str, Any]:
    """What each --verify mode costs: the whole run (and its verify stage) with none, stream and disk.

    ``disk`` reads every copy back after the fsync; its ceiling is the same reads and hashes
    done raw, measured in the same run (``raw_hash_seconds``: every rank's copy, 4 threads a
    rank as the tool's leaders use, all at once as the leaders do on this one machine).
    """
    source = emu.url(CONTAINER, prefix)
    env = {**os.environ, **emu.key_env()}
    modes = {"none": [], "stream": ["--verify=stream"], "disk": ["--verify"]}
    samples: dict[str, dict[str, list[float]]] = {m: {"total": [], "verify": []} for m in modes}
    raw: list[float] = []
    nbytes = 0
    work = Path(tempfile.mkdtemp(prefix="azcp-bench-verify-"))
    try:
        for repeat in range(repeats):
            order = list(modes)[repeat % len(modes) :] + list(modes)[: repeat % len(modes)]
            for mode in order:
                doc = _tool_download(source, work / "{rank}", env, ranks, ["--compare", "none", *modes[mode]])
                nbytes = doc["bytes"]
                samples[mode]["total"].append(doc["stages"]["total"]["seconds"])
                samples[mode]["verify"].append(doc["stages"]["verify"]["seconds"])
                if mode == "disk":
                    _quiesce()
                    copies = [p for r in range(ranks) for p in sorted((work / str(r)).rglob("*.bin"))]
                    raw.append(_raw_hash(copies, 4 * ranks, direct=True))
            for r in range(ranks):
                shutil.rmtree(work / str(r), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"bytes": nbytes, "ranks": ranks, "repeats": repeats}
    base = statistics.median(samples["none"]["total"])
    for mode, figures in samples.items():
        total, verify = statistics.median(figures["total"]), statistics.median(figures["verify"])
        out[mode] = {
            "total_seconds": round(total, 3),
            "verify_seconds": round(verify, 3),
            "overhead": round(total / base - 1, 3),
            # Only the read-back takes time of its own; the in-flight hashing shows in the total.
            "verify_mib_s": round(nbytes / MiB / verify, 1) if mode == "disk" and verify else None,
            "samples": {k: [round(x, 3) for x in v] for k, v in figures.items()},
        }
    hashed = statistics.median(raw)
    out["disk"]["raw_hash_seconds"] = round(hashed, 3)
    out["disk"]["raw_hash_mib_s"] = round(nbytes / MiB / hashed, 1)
    out["disk"]["ratio"] = round(hashed / out["disk"]["verify_seconds"], 3)
    return out


def bcast_sweep(emu: azurite.Emulator, prefix: str, ranks: int, png: Path | None) -> dict[str, Any]:
    """The fan-out alone (a two-phase copy's bcast stage) over chunk x pipeline x writers x O_DIRECT, one
    dataset; optional plot."""
    source = emu.url(CONTAINER, prefix)
    env = {**os.environ, **emu.key_env()}
    rows = []
    work = Path(tempfile.mkdtemp(prefix="azcp-bench-sweep-"))
    try:
        for chunk in (4 * MiB, 16 * MiB, 64 * MiB):
            for pipeline in (1, 4):
                for writers in (1, 2):
                    for direct in (True, False):
                        # Two-phase: the bcast stage of a streamed copy also waits for the download.
                        extra = [*_bcast_args(chunk, pipeline, writers, direct), "--no-overlap"]
                        runs = []
                        for _ in range(2):
                            doc = _tool_download(source, work / "{rank}", env, ranks, extra)
                            runs.append(doc["broadcast_bytes"] / MiB / doc["stages"]["bcast"]["seconds"])
                            for r in range(ranks):
                                shutil.rmtree(work / str(r), ignore_errors=True)
                        rows.append(
                            {
                                "chunk_mib": chunk // MiB,
                                "pipeline": pipeline,
                                "writers": writers,
                                "direct": direct,
                                "mib_s": round(statistics.median(runs), 1),
                            }
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if png is not None:
        _plot(rows, png)
    return {"ranks": ranks, "rows": rows}


def _plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, direct in zip(axes, (True, False), strict=True):
        for pipeline in (1, 4):
            for writers in (1, 2):
                pts = [
                    r for r in rows if r["direct"] == direct and r["pipeline"] == pipeline and r["writers"] == writers
                ]
                ax.plot(
                    [r["chunk_mib"] for r in pts],
                    [r["mib_s"] for r in pts],
                    marker="o",
                    label=f"pipeline {pipeline}, writers {writers}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("--bcast-chunk (MiB)")
        ax.set_title("O_DIRECT" if direct else "page cache (--no-bcast-direct)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("bcast MiB/s per receiver")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def disk_irq_counts(path: str) -> dict[int, int]:
    """Interrupts per CPU so far of the block device under ``path`` ({} when it cannot tell).

    The device is found through sysfs (``/sys/dev/block/MAJ:MIN``, whose real path names
    ``virtioN`` or ``nvmeN``) and its queues' lines in ``/proc/interrupts``.
    """
    st = os.stat(path)
    sysfs = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not sysfs.exists():
        return {}  # tmpfs, overlay, a network filesystem
    names = [p for p in sysfs.resolve().parts if re.fullmatch(r"(virtio|nvme)\d+", p)]
    if not names:
        return {}
    lines = Path("/proc/interrupts").read_text().splitlines()
    cpus = [int(c[3:]) for c in lines[0].split()]
    counts = dict.fromkeys(cpus, 0)
    for line in lines[1:]:
        fields = line.split()
        if not fields or not any(re.match(rf"{n}(\D|$)", fields[-1]) for n in names):
            continue
        for cpu, value in zip(cpus, fields[1 : 1 + len(cpus)], strict=False):
            counts[cpu] += int(value) if value.isdigit() else 0
    return counts


def server_cpu(cpus: list[int], dest_parent: str) -> int:
    """The CPU for the emulator: the one that services the fewest of the disk's interrupts.

    On a cluster the storage service does not run on the node, and the node's own cores
    take its disk's interrupts and their completion work. Here the emulator is pinned to a
    core; if that core also took the disk's interrupts (and the kernel's work that finishes
    each O_DIRECT write), every byte the client writes would slow the server down. Ties
    (or no information) go to the last CPU.
    """
    counts = disk_irq_counts(dest_parent)
    return min(reversed(cpus), key=lambda c: counts.get(c, 0))


def machine() -> dict[str, Any]:
    """Where the figures came from."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print (and optionally write) the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small dataset, fewer repeats (a minute or two)")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument("--block-size", default="16MiB")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--no-pin", action="store_true", help="let the emulator share the client's cores")
    parser.add_argument(
        "--ranks",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="ranks for the broadcast benchmark (default: one per core, at most 4; oversubscribed ranks "
        "spin in MPI and starve each other's disk threads, which no cluster node does)",
    )
    parser.add_argument("--bcast-chunk", help="the tool's --bcast-chunk (default: the tool's own)")
    parser.add_argument("--fanout", help="the tool's --fanout (default: the tool's own)")
    parser.add_argument("--sweep", action="store_true", help="also sweep chunk, pipeline, writers and O_DIRECT")
    parser.add_argument("--plot", metavar="PNG", help="with --sweep: plot it (needs the 'bench' extra: matplotlib)")
    parser.add_argument("--bcast-pipeline", type=int, default=4)
    parser.add_argument("--bcast-writers", type=int, default=2)
    args = parser.parse_args(argv)
    blob_size, blobs, repeats = (64 * MiB, 8, 5) if args.quick else (128 * MiB, 8, 7)
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus: set[int] | None = None
    if len(cpus) >= 2 and not args.no_pin:
        # The emulator stands in for a remote service: give it its own core, so that the
        # client's CPU (the thing measured) does not slow the server down, for both the
        # ceiling and the tool alike; a core that does not take the disk's interrupts.
        server_cpus = {server_cpu(cpus, tempfile.gettempdir())}
        os.sched_setaffinity(0, set(cpus) - server_cpus)
    results["pinning"] = {"server": sorted(server_cpus or []), "client": sorted(os.sched_getaffinity(0))}
    with azurite.running(cpus=server_cpus) as emu:
        results["download"] = bench_download(
            emu, blob_size, blobs, repeats, parse_size(args.block_size), args.concurrency
        )
        os.sched_setaffinity(0, set(cpus))  # the broadcast runs after the download: no server traffic
        half = [f"blob-00[0-{blobs // 2 - 1}].bin"]
        results["bcast"] = bench_bcast(
            emu,
            "dl",
            {"small": half, "large": []},
            args.ranks,
            repeats,
            parse_size(args.bcast_chunk) if args.bcast_chunk else None,
            args.bcast_pipeline,
            args.bcast_writers,
            fanout=args.fanout,
        )
        results["verify"] = bench_verify(emu, "dl", args.ranks, 3 if args.quick else 5)
        if args.sweep:
            results["bcast_sweep"] = bcast_sweep(emu, "dl", args.ranks, Path(args.plot) if args.plot else None)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
