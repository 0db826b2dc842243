"""The pure stages at scale: a synthetic listing of a million files, planned for 1,024 ranks.

    python -m benchmarks.scale [--files 1000000] [--ranks 1024] [--json FILE]

Times the listing's encoding (what rank 0 broadcasts), then, in a fresh process that holds
only what a rank holds, its decoding (every rank decodes it), the plan
(``plan.plan_transfers``: LPT over the ranks) and the schedule
(``schedule.transfer_schedule``: the leaders' transfers, packed), with that process's peak
RSS and the plan's spread over the mean. Twice: with the cyclic collector paused as the
pipeline runs these stages (``collector.paused``), and with it running, for comparison.
Issue 17's target: plan, schedule and decode together within 5 s and 1 GiB.

The size mix, fixed by a seed: a third of the files under 64 KiB, a third under 4 MiB, and
of the rest 1 % up to 2 GiB (checkpoint shards), the others 1,000 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from azcp_cluster import collector
from azcp_cluster.model import FileEntry, Listing, decode_listing, encode_listing
from azcp_cluster.plan import plan_transfers
from azcp_cluster.schedule import transfer_schedule


def synthetic(files: int, seed: int = 1) -> Listing:
    """A listing of ``files`` files with the module's size mix (names like a sharded dataset)."""
    rng = random.Random(seed)
    entries = []
    for i in range(files):
        kind = rng.random()
        if kind < 1 / 3:
            size = rng.randrange(0, 64 << 10)
        elif kind < 2 / 3:
            size = rng.randrange(0, 4 << 20)
        else:
            size = rng.randrange(0, 2 << 30) if rng.random() < 0.01 else 1000
        name = f"train/part-{i // 1000:05d}/sample-{i:08d}.bin"
        entries.append(FileEntry(name=name, path=name, size=size, etag=f'"0x8DB{i:012X}"'))
    return Listing(files=tuple(entries))


def rank_side(blob: bytes, ranks: int, paused: bool) -> dict[str, Any]:
    """What every rank does with the listing it receives: decode it, plan, schedule (timed),
    with the cyclic collector paused as the pipeline runs them (``paused``) or running."""
    figures: dict[str, Any] = {}
    with collector.paused() if paused else contextlib.nullcontext():
        started = time.perf_counter()
        decoded = decode_listing(blob)
        figures["decode_s"] = round(time.perf_counter() - started, 2)
        sizes = [f.size for f in decoded.files]
        holders = tuple(() for _ in sizes)  # what the diff gives on a first copy
        started = time.perf_counter()
        plan = plan_transfers(sizes, holders, ranks, 1 << 30)
        figures["plan_s"] = round(time.perf_counter() - started, 2)
        figures["shards"] = len(plan.shards)
        figures["spread"] = round(plan.spread(), 6)
        started = time.perf_counter()
        schedule = transfer_schedule(plan, 64 << 20, ranks)
        figures["schedule_s"] = round(time.perf_counter() - started, 2)
        figures["transfers"] = len(schedule)
    figures["decode_plan_schedule_s"] = round(figures["decode_s"] + figures["plan_s"] + figures["schedule_s"], 2)
    # ru_maxrss is in KiB on Linux: this process holds only what a rank holds.
    figures["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print (and with --json write) its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--rank-side", metavar="LISTING", help=argparse.SUPPRESS)  # the child's part
    parser.add_argument("--running", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side:
        print(json.dumps(rank_side(Path(args.rank_side).read_bytes(), args.ranks, not args.running)))
        return 0
    listing = synthetic(args.files)
    figures: dict[str, Any] = {"files": args.files, "ranks": args.ranks}
    started = time.perf_counter()
    blob = encode_listing(listing)
    figures["encode_s"] = round(time.perf_counter() - started, 2)
    figures["encoded_bytes_per_file"] = round(len(blob) / args.files, 1)
    assert decode_listing(blob) == listing
    del listing
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "listing"
        path.write_bytes(blob)
        # A fresh process per measurement: its peak memory is a rank's, not this generator's.
        for name, extra in (("as_run", []), ("collector_running", ["--running"])):
            child = [sys.executable, "-m", "benchmarks.scale", "--rank-side", str(path), "--ranks", str(args.ranks)]
            out = subprocess.run([*child, *extra], check=True, capture_output=True, text=True).stdout
            figures[name] = json.loads(out)
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
