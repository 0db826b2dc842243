"""The pure stages at scale: a synthetic listing of a million files, planned for 1,024 ranks.

    python -m benchmarks.scale [--files 1000000] [--ranks 1024] [--json FILE]

Times (one run each, this process) the listing's encoding and decoding (what rank 0
broadcasts and every rank decodes), the plan (``plan.plan_transfers``: LPT over the ranks)
and the schedule (``schedule.transfer_schedule``: the leaders' transfers, packed), and the
process's peak RSS; and the plan's spread over the mean. Issue 17's target: plan, schedule
and decode together within 5 s and 1 GiB.

The size mix, fixed by a seed: a third of the files under 64 KiB, a third under 4 MiB, and
of the rest 1 % up to 2 GiB (checkpoint shards), the others 1,000 bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path
from typing import Any

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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print (and with --json write) its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    listing = synthetic(args.files)
    figures: dict[str, Any] = {"files": args.files, "ranks": args.ranks}

    started = time.perf_counter()
    blob = encode_listing(listing)
    figures["encode_s"] = round(time.perf_counter() - started, 2)
    figures["encoded_bytes_per_file"] = round(len(blob) / args.files, 1)
    started = time.perf_counter()
    decoded = decode_listing(blob)
    figures["decode_s"] = round(time.perf_counter() - started, 2)
    assert decoded == listing
    sizes = [f.size for f in decoded.files]

    started = time.perf_counter()
    plan = plan_transfers(sizes, [[] for _ in sizes], args.ranks, 1 << 30)
    figures["plan_s"] = round(time.perf_counter() - started, 2)
    figures["shards"] = len(plan.shards)
    figures["spread"] = round(plan.spread(), 6)
    started = time.perf_counter()
    schedule = transfer_schedule(plan, 64 << 20, args.ranks)
    figures["schedule_s"] = round(time.perf_counter() - started, 2)
    figures["transfers"] = len(schedule)
    figures["decode_plan_schedule_s"] = round(figures["decode_s"] + figures["plan_s"] + figures["schedule_s"], 2)
    # ru_maxrss is in KiB on Linux.
    figures["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
