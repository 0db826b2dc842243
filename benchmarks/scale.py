"""The pure stages at scale: a synthetic listing of a million files, planned for 1,024 ranks, per size mix.

    python -m benchmarks.scale [--mix NAME] [--files 1000000] [--ranks 1024] [--repeat N]
                               [--collector-running] [--json FILE]

For each size mix (``--mix`` for one, default all of :data:`MIXES`): makes the listing,
times its encoding (what rank 0 broadcasts), then, in a fresh process that holds only what
a rank holds, its decoding (every rank decodes it), the plan (``plan.plan_transfers``: LPT
over the ranks, 1 GiB shards) and the schedule (``packing.transfer_schedule``: the
transfers, packed into 64 MiB slots), with that process's peak RSS, the number of shards
and transfers and the plan's spread over the mean. The cyclic collector is paused as the
pipeline pauses it (``collector.paused``); ``--collector-running`` measures it running too.
``--repeat N`` runs the rank's side N times per mix and reports each figure's median (the
runs' totals are listed too: their spread is the machine's noise).

Issue 17's target, and issue 23's on every mix: decode, plan and schedule together within
5 s and 1 GiB.

The names are those of a sharded dataset (``train/part-00012/sample-00012345.bin``) and
every file has an ETag, whatever the mix: the decode costs the same on every mix, the plan
and the schedule are what the sizes change. Every mix is fixed by a seed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from azcp_cluster.core.model import FileEntry, Listing, decode_listing, encode_listing
from azcp_cluster.core.packing import transfer_schedule
from azcp_cluster.core.plan import plan_transfers
from azcp_cluster.run import collector

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
SHARD_SIZE = 1 * GiB  # the tool's default --shard-size
SLOT_SIZE = 64 * MiB  # the tool's default --bcast-chunk


def standard_sizes(files: int, seed: int = 1) -> list[int]:
    """Issue 17's mix (the benchmark's only one until issue 23), drawn as it always was: a third
    under 64 KiB, a third under 4 MiB, and of the rest 1 % up to 2 GiB (checkpoint shards),
    the others 1,000 bytes."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(files):
        kind = rng.random()
        if kind < 1 / 3:
            size = rng.randrange(0, 64 << 10)
        elif kind < 2 / 3:
            size = rng.randrange(0, 4 << 20)
        else:
            size = rng.randrange(0, 2 << 30) if rng.random() < 0.01 else 1000
        sizes.append(size)
    return sizes


def _uniform(rng: np.random.Generator, count: int, low: int, high: int) -> np.ndarray:
    return rng.integers(low, high, size=count, dtype=np.int64)


def tester_sizes(files: int, rng: np.random.Generator) -> np.ndarray:
    """The outside tester's mix (issue 23): 1 % of 1-8 GiB, the rest half 1-64 MiB, half under 64 KiB."""
    kind = rng.random(files)
    sizes = _uniform(rng, files, 0, 64 * KiB)
    medium = kind >= 0.495
    sizes[medium] = _uniform(rng, int(medium.sum()), 1 * MiB, 64 * MiB + 1)
    large = kind >= 0.99
    sizes[large] = _uniform(rng, int(large.sum()), 1 * GiB, 8 * GiB + 1)
    return sizes


def bimodal_sizes(files: int, rng: np.random.Generator) -> np.ndarray:
    """Two humps: 90 % of 4-16 KiB (labels, thumbnails), 10 % of 100-300 MiB (videos, shards)."""
    sizes = _uniform(rng, files, 4 * KiB, 16 * KiB + 1)
    large = rng.random(files) < 0.10
    sizes[large] = _uniform(rng, int(large.sum()), 100 * MiB, 300 * MiB + 1)
    return sizes


def pareto_sizes(files: int, rng: np.random.Generator) -> np.ndarray:
    """Heavy-tailed: Pareto with alpha 1.1 from 4 KiB (the 80/20 rule and then some), capped at 64 GiB:
    most files a few KiB, a few of GiBs."""
    sizes = (4 * KiB) * (1.0 + rng.pareto(1.1, files))
    return np.minimum(sizes, 64 * GiB).astype(np.int64)


def tib_sizes(files: int, rng: np.random.Generator) -> np.ndarray:
    """One file of 1 TiB among a million under 64 KiB: the one file's 1,024 shards (one a rank)
    and 16,384 transfers, with the many small files packed around them."""
    sizes = _uniform(rng, files, 0, 64 * KiB)
    sizes[files // 2] = 1 * TiB
    return sizes


# name -> (what it is, sizes for a number of files, or None for a fixed number of files)
MIXES: dict[str, tuple[str, Callable[[int, np.random.Generator], Any], int | None]] = {
    "standard": (
        "issue 17's: 1/3 < 64 KiB, 1/3 < 4 MiB, 1/3 of 1,000 B but 1 % of them < 2 GiB",
        lambda files, rng: standard_sizes(files),
        None,
    ),
    "tester": ("issue 23's: 1 % of 1-8 GiB, the rest half 1-64 MiB, half < 64 KiB", tester_sizes, None),
    "small": ("all < 64 KiB", lambda files, rng: _uniform(rng, files, 0, 64 * KiB), None),
    "medium": ("all 1-64 MiB", lambda files, rng: _uniform(rng, files, 1 * MiB, 64 * MiB + 1), None),
    "bimodal": ("90 % of 4-16 KiB, 10 % of 100-300 MiB", bimodal_sizes, None),
    "pareto": ("Pareto alpha 1.1 from 4 KiB, capped at 64 GiB", pareto_sizes, None),
    "large": (
        "all 64-512 MiB (275 TiB: 4.5 M transfers, where the schedule's size nears its bound)",
        lambda files, rng: _uniform(rng, files, 64 * MiB, 512 * MiB + 1),
        None,
    ),
    "tib": ("one file of 1 TiB, the rest < 64 KiB", tib_sizes, None),
    "tib-alone": ("one file of 1 TiB, alone", lambda files, rng: [1 * TiB], 1),
}


def synthetic(files: int, mix: str = "standard", seed: int = 1) -> Listing:
    """A listing of ``files`` files with the named mix's sizes (names like a sharded dataset)."""
    _, sizes_of, fixed = MIXES[mix]
    files = fixed if fixed is not None else files
    sizes = [int(size) for size in sizes_of(files, np.random.default_rng(seed))]
    entries = []
    for i, size in enumerate(sizes):
        name = f"train/part-{i // 1000:05d}/sample-{i:08d}.bin"
        entries.append(FileEntry(name=name, path=name, size=size, etag=f'"0x8DB{i:012X}"'))
    return Listing(files=tuple(entries))


def peak_rss_mib() -> int:
    """This process's peak resident memory, MiB: the kernel's high-water mark of its own memory map.

    Not ``getrusage``'s ``ru_maxrss``: Linux carries that over ``execve`` from the process that
    forked (here the generator, holding a listing of its own), so a fresh child reported the
    parent's peak whenever it was the larger (issue 17's figures did).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # not Linux


def rank_side(blob: bytes, ranks: int, paused: bool) -> dict[str, Any]:
    """What every rank does with the listing it receives: decode it, plan, schedule (timed: wall
    and this process's CPU seconds), with the cyclic collector paused as the pipeline runs them
    (``paused``) or running."""
    figures: dict[str, Any] = {}
    wall, cpu = time.perf_counter, time.process_time
    with collector.paused() if paused else contextlib.nullcontext():
        started, used = wall(), cpu()
        decoded = decode_listing(blob)
        figures["decode_s"], figures["decode_cpu_s"] = wall() - started, cpu() - used
        sizes = [f.size for f in decoded.files]
        holders = tuple(() for _ in sizes)  # what the diff gives on a first copy
        started, used = wall(), cpu()
        plan = plan_transfers(sizes, holders, ranks, SHARD_SIZE)
        figures["plan_s"], figures["plan_cpu_s"] = wall() - started, cpu() - used
        figures["shards"] = plan.shard_count
        figures["spread"] = round(plan.spread(), 6)
        started, used = wall(), cpu()
        schedule = transfer_schedule(plan, SLOT_SIZE, ranks)
        figures["schedule_s"], figures["schedule_cpu_s"] = wall() - started, cpu() - used
        figures["transfers"] = len(schedule)
    figures["decode_plan_schedule_s"] = figures["decode_s"] + figures["plan_s"] + figures["schedule_s"]
    figures["decode_plan_schedule_cpu_s"] = figures["decode_cpu_s"] + figures["plan_cpu_s"] + figures["schedule_cpu_s"]
    figures["peak_rss_mib"] = peak_rss_mib()  # this process holds only what a rank holds
    return figures


def median_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (the counts are the same in every run), rounded."""
    figures: dict[str, Any] = {}
    for key in runs[0]:
        value = statistics.median(run[key] for run in runs)
        figures[key] = round(value, 2) if key.endswith("_s") else value
    if len(runs) > 1:
        figures["totals_s"] = [round(run["decode_plan_schedule_s"], 2) for run in runs]
    return figures


def measure(mix: str, files: int, ranks: int, repeat: int, running_too: bool) -> dict[str, Any]:
    """One mix's figures: the encoding here, the rank's side in fresh processes."""
    listing = synthetic(files, mix)
    sizes = [f.size for f in listing.files]
    figures: dict[str, Any] = {
        "mix": MIXES[mix][0],
        "files": len(sizes),
        "bytes": sum(sizes),
        "ranks": ranks,
    }
    started = time.perf_counter()
    blob = encode_listing(listing)
    figures["encode_s"] = round(time.perf_counter() - started, 2)
    figures["encoded_bytes_per_file"] = round(len(blob) / len(sizes), 1)
    del listing, sizes
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "listing"
        path.write_bytes(blob)
        del blob
        # A fresh process per measurement: its peak memory is a rank's, not this generator's.
        child = [sys.executable, "-m", "benchmarks.scale", "--rank-side", str(path), "--ranks", str(ranks)]
        kinds: list[tuple[str, list[str]]] = [("as_run", [])] + (
            [("collector_running", ["--running"])] if running_too else []
        )
        for name, extra in kinds:
            runs = []
            for _ in range(repeat):
                out = subprocess.run([*child, *extra], check=True, capture_output=True, text=True).stdout
                runs.append(json.loads(out))
            figures[name] = median_figures(runs)
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print (and with --json write) its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mix", choices=sorted(MIXES), help="one mix (default: every mix)")
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=1, help="runs of the rank's side per mix (medians)")
    parser.add_argument("--collector-running", action="store_true", help="measure with the collector running too")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--rank-side", metavar="LISTING", help=argparse.SUPPRESS)  # the child's part
    parser.add_argument("--running", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side:
        print(json.dumps(rank_side(Path(args.rank_side).read_bytes(), args.ranks, not args.running)))
        return 0
    mixes = [args.mix] if args.mix else list(MIXES)
    figures: dict[str, Any] = {}
    for mix in mixes:
        figures[mix] = measure(mix, args.files, args.ranks, max(1, args.repeat), args.collector_running)
        shown = figures[mix]["as_run"]
        print(
            f"{mix:10} decode {shown['decode_s']:5.2f} s  plan {shown['plan_s']:5.2f} s  "
            f"schedule {shown['schedule_s']:5.2f} s  total {shown['decode_plan_schedule_s']:5.2f} s "
            f"(cpu {shown['decode_plan_schedule_cpu_s']:5.2f} s)  "
            f"peak {shown['peak_rss_mib']:5} MiB  {shown['shards']:9,} shards  {shown['transfers']:9,} transfers  "
            f"spread {shown['spread']:.6f}",
            file=sys.stderr,
            flush=True,
        )
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
