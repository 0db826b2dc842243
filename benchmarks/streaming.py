"""Benchmarks of issue 14: streaming against two phases, and trees of small files.

    python benchmarks/streaming.py [--quick] [--https] [--only overlap,small,blobs] [--old COMMIT] [--json FILE]

overlap: the same dataset on the emulator, the tool streaming (download and fan-out at once)
    and the same tool ``--no-overlap`` (two phases: its download and broadcast stages are
    each stage alone), alternating, for 2 ranks as 2 nodes (DEST per rank) and 2 ranks on
    one node (one DEST: one leader fans out what both download). Compared: the streamed
    stage (``[bcast]`` in streaming mode, which spans the download) against the slower of
    the two stages alone, and against the sum of the two.
small: 20,000 files of 0 to 16 KiB (seeded) from a local SOURCE to 2 ranks as 2 nodes, the
    tool's ``[total]`` against ``tar cf - SRC | tar xf -`` into two directories plus ``sync``;
    each run starts from a removed DEST and a ``sync``; alternating.
blobs: 5,000 small blobs (0 to 16 KiB) from the emulator to 4 ranks as 4 nodes, the tool at
    this commit against a worktree of ``--old`` (the commit before issue 14), alternating.

Medians of ``--repeats`` runs; every figure of every run is kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.certs import make_certificate
from azcp_cluster.devtools.datasets import pseudo_random
from benchmarks.run import mpiexec

REPO = Path(__file__).resolve().parents[1]
OLD = "ec58a2f"  # main before issue 14


def _sync() -> None:
    subprocess.run(["sync"], check=True)


def _tool(
    source: str, dest: str, ranks: int, extra: list[str], env: dict[str, str], pythonpath: str | None = None
) -> dict[str, Any]:
    """Run the tool; return its JSON report with the wall time of the whole command added."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        run_env = dict(env)
        if pythonpath:
            run_env["PYTHONPATH"] = pythonpath
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "azcp_cluster", source, dest, "--no-progress",
               "--json", str(report), *extra]  # fmt: skip
        started = time.monotonic()
        subprocess.run(cmd, env=run_env, check=True, stdout=subprocess.DEVNULL)
        doc: dict[str, Any] = json.loads(report.read_text())
        doc["wall"] = time.monotonic() - started
        return doc


def _tls_env(emu: azurite.Emulator) -> dict[str, str]:
    """An HTTPS emulator's certificate, trusted by the tool (its listing and its GETs)."""
    return {"SSL_CERT_FILE": emu.ca_file, "REQUESTS_CA_BUNDLE": emu.ca_file} if emu.ca_file else {}


def _stage(doc: dict[str, Any], name: str) -> float:
    return float(doc["stages"][name]["seconds"])


def bench_overlap(emu: azurite.Emulator, work: Path, repeats: int, quick: bool) -> dict[str, Any]:
    """Streaming against two phases, same data, same run; for 2 nodes and for 1 node of 2 ranks."""
    blobs, size = (4, 64 * MiB) if quick else (8, 64 * MiB)
    container = "overlap"
    azurite.upload(emu, container, {f"o/b{i}.bin": pseudo_random(size, f"o{i}") for i in range(blobs)})
    # A small window of ranged GETs in flight (8 x 4 MiB per rank): the first bytes land
    # early, as they do from a real account with its much larger dataset.
    common = ["--block-size", "4MiB", "--concurrency", "8", "--bcast-chunk", "16MiB", "--compare", "none"]
    out: dict[str, Any] = {"blobs": blobs, "blob_bytes": size, "options": common}
    env = {**os.environ, **emu.key_env(), **_tls_env(emu)}
    out["scheme"] = emu.scheme
    for layout, dest in (("two_nodes", "{rank}"), ("one_node", "shared")):
        runs: dict[str, list[dict[str, Any]]] = {"stream": [], "two_phase": []}
        for i in range(repeats):
            order = ["stream", "two_phase"] if i % 2 == 0 else ["two_phase", "stream"]
            for mode in order:
                target = work / f"ov-{layout}-{i}-{mode}"  # fresh: see bench_small
                _sync()
                extra = common + ([] if mode == "stream" else ["--no-overlap"])
                doc = _tool(emu.url(container, "o"), str(target / dest), 2, extra, env)
                runs[mode].append(
                    {"download": _stage(doc, "download"), "bcast": _stage(doc, "bcast"), "total": _stage(doc, "total")}
                )
        for leftover in work.glob(f"ov-{layout}-*"):
            shutil.rmtree(leftover, ignore_errors=True)

        def med(mode: str, key: str, runs: dict[str, list[dict[str, Any]]] = runs) -> float:
            return float(statistics.median(r[key] for r in runs[mode]))

        download_alone = med("two_phase", "download")
        bcast_alone = med("two_phase", "bcast")
        streamed = med("stream", "bcast")  # the streamed stage spans the download
        out[layout] = {
            "runs": runs,
            "download_alone": download_alone,
            "bcast_alone": bcast_alone,
            "two_phase_stages": med("two_phase", "download") + med("two_phase", "bcast"),
            "streamed_stage": streamed,
            "stream_total": med("stream", "total"),
            "two_phase_total": med("two_phase", "total"),
            "ratio_to_slower_stage": streamed / max(download_alone, bcast_alone),
            "ratio_to_two_phase": streamed / (download_alone + bcast_alone),
            "total_ratio_to_two_phase": med("stream", "total") / med("two_phase", "total"),
        }
    return out


def _small_tree(root: Path, files: int, seed: int) -> int:
    rng = random.Random(seed)
    total = 0
    for i in range(files):
        folder = root / f"d{i % 50:02d}" / f"e{(i // 50) % 8}"
        folder.mkdir(parents=True, exist_ok=True)
        size = rng.randrange(0, 16 * 1024 + 1)
        (folder / f"f{i:05d}.bin").write_bytes(rng.randbytes(size))
        total += size
    return total


def bench_small(work: Path, repeats: int, files: int) -> dict[str, Any]:
    """20,000 small files from a local SOURCE to 2 nodes, against two tar|tar copies plus sync."""
    src = work / "small-src"
    total = _small_tree(src, files, 14)
    runs: dict[str, list[float]] = {"tool": [], "tool_wall": [], "tar": []}
    for i in range(repeats):
        for what in ["tool", "tar"] if i % 2 == 0 else ["tar", "tool"]:
            target = work / "small-dest"
            shutil.rmtree(target, ignore_errors=True)
            _sync()
            if what == "tool":
                doc = _tool(str(src), str(target / "{rank}"), 2, [], dict(os.environ))
                runs["tool"].append(_stage(doc, "total"))
                runs["tool_wall"].append(doc["wall"])
            else:
                started = time.monotonic()
                for copy in ("0", "1"):
                    (target / copy).mkdir(parents=True)
                    subprocess.run(
                        f"tar cf - -C {src.parent} {src.name} | tar xf - -C {target / copy}", shell=True, check=True
                    )
                _sync()
                runs["tar"].append(time.monotonic() - started)
    for leftover in work.glob("small-dest-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    tool, tar = statistics.median(runs["tool"]), statistics.median(runs["tar"])
    return {"files": files, "bytes": total, "runs": runs, "tool_total": tool, "tar_twice_and_sync": tar,
            "ratio": tool / tar, "tool_wall": statistics.median(runs["tool_wall"])}  # fmt: skip


def bench_blobs(emu: azurite.Emulator, work: Path, repeats: int, blobs: int, old: str) -> dict[str, Any]:
    """5,000 small blobs to 4 ranks as 4 nodes: this commit against a worktree of ``old``."""
    container = "smallblobs"
    rng = random.Random(5)
    azurite.upload(emu, container, {f"s/{i % 40:02d}/b{i:05d}.bin": rng.randbytes(rng.randrange(0, 16385))
                                    for i in range(blobs)})  # fmt: skip
    tree = work / "old-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), old], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    runs: dict[str, list[float]] = {"new": [], "old": []}
    env = {**os.environ, **emu.key_env(), **_tls_env(emu)}
    try:
        for i in range(repeats):
            for which in ["new", "old"] if i % 2 == 0 else ["old", "new"]:
                target = work / "blobs-dest"
                shutil.rmtree(target, ignore_errors=True)
                _sync()
                doc = _tool(emu.url(container, "s"), str(target / "{rank}"), 4, [], env,
                            pythonpath=str(tree) if which == "old" else str(REPO))  # fmt: skip
                runs[which].append(_stage(doc, "total"))
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        for leftover in work.glob("blobs-dest-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    new, prev = statistics.median(runs["new"]), statistics.median(runs["old"])
    return {"blobs": blobs, "old_commit": old, "runs": runs, "new_total": new, "old_total": prev, "speedup": prev / new}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen benchmarks and print (and optionally write) the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, a smaller overlap dataset")
    parser.add_argument("--only", default="overlap,small,blobs")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--old", default=OLD, help=f"the commit to compare the small blobs with (default {OLD})")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--https", action="store_true", help="the emulator over HTTPS (a self-signed certificate)")
    args = parser.parse_args(argv)
    chosen = set(args.only.split(","))
    repeats = args.repeats or (3 if args.quick else 5)
    results: dict[str, Any] = {"quick": args.quick, "repeats": repeats, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(dir=os.environ.get("AZCP_BENCH_DIR")) as tmp:
        work = Path(tmp)
        if "small" in chosen:
            results["small"] = bench_small(work, repeats, 20_000)
        if chosen & {"overlap", "blobs"}:
            cert: str | None = None
            key: str | None = None
            if args.https:
                cert_path, key_path = make_certificate(work)
                cert, key = str(cert_path), str(key_path)
            with azurite.running(cert=cert, key=key) as emu:
                if "overlap" in chosen:
                    results["overlap"] = bench_overlap(emu, work, repeats, args.quick)
                if "blobs" in chosen:
                    results["blobs"] = bench_blobs(emu, work, repeats, 5_000, args.old)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
