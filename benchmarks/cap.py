"""Benchmark of issue 23 item 5: does ``--max-bandwidth`` hold over short copies?

    python benchmarks/cap.py [--quick] [--repeats N] [--json FILE]

Copies from the emulator under a cap, for every combination of 1 and 2 ranks (2 ranks as 2
nodes), ``--download-workers 1`` and 2, and block sizes of 1 MiB and 16 MiB: a 31 MiB blob
at 8 MiB/s (about 3.9 s at the cap) and 200 MiB in 4 blobs at 64 MiB/s (about 3.1 s). Each
run's achieved rate is the downloaded bytes over the download stage's time, both from the
JSON report (its ``download_rate`` where there is one); the wall time of the whole command
is kept too. The cap holds when every run's rate is at most 1.05 x the cap (a copy of 2 s
or more: the pacer's burst is 0.1 s of the rate). ``--quick``: the 16 MiB blocks only.
Medians of ``--repeats`` runs (default 1); every run is kept in the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
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
from azcp_cluster.devtools.datasets import pseudo_random
from benchmarks.run import mpiexec

CONTAINER = "cap"
# name: (blobs {name: size}, cap in bytes per second)
COPIES = {
    "31MiB@8MiB/s": ({"short/one.bin": 31 * MiB}, 8 * MiB),
    "200MiB@64MiB/s": ({f"long/part-{i}.bin": 50 * MiB for i in range(4)}, 64 * MiB),
}
TOLERANCE = 1.05


def _run(emu: azurite.Emulator, prefix: str, ranks: int, workers: int, block: str, cap: int) -> dict[str, Any]:
    """One capped copy into fresh DESTs: the report's figures and the command's wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "azcp_cluster", emu.url(CONTAINER, prefix)]
        cmd += [f"{tmp}/{{rank}}", "--no-progress", "--json", str(report), "--block-size", block]
        cmd += ["--download-workers", str(workers), "--max-bandwidth", str(cap)]
        # No proxy of the machine's: the emulator is on loopback.
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and not k.startswith("AZURE_")}
        env.update(emu.key_env())
        started = time.monotonic()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        doc = json.loads(report.read_text())
    seconds = doc["stages"]["download"]["seconds"]
    rate = doc.get("download_rate") or doc["downloaded_bytes"] / seconds
    return {"seconds": seconds, "bytes": doc["downloaded_bytes"], "rate": rate, "ratio": rate / cap, "wall": wall}


def main() -> None:
    """Run the matrix; print one line per case and whether the cap held."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 MiB blocks only")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    blocks = ["16MiB"] if args.quick else ["1MiB", "16MiB"]
    results: list[dict[str, Any]] = []
    held = True
    with azurite.running() as emu:
        for blobs, _ in COPIES.values():
            azurite.upload(emu, CONTAINER, {name: pseudo_random(size, name) for name, size in blobs.items()})
        for (name, (blobs, cap)), ranks, workers, block in itertools.product(COPIES.items(), (1, 2), (1, 2), blocks):
            prefix = next(iter(blobs)).split("/")[0]
            runs = [_run(emu, prefix, ranks, workers, block, cap) for _ in range(args.repeats)]
            ratio = statistics.median(r["ratio"] for r in runs)
            worst = max(r["ratio"] for r in runs)
            ok = worst <= TOLERANCE
            held = held and ok
            seconds = statistics.median(r["seconds"] for r in runs)
            print(
                f"{name:>15} ranks={ranks} workers={workers} block={block:>5}: T={seconds:6.3f}s "
                f"rate/cap median {ratio:.3f} worst {worst:.3f} {'ok' if ok else 'OVER'}",
                flush=True,
            )
            results.append({"copy": name, "ranks": ranks, "workers": workers, "block": block, "cap": cap, "runs": runs})
    print("the cap held" if held else "the cap did NOT hold")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(0 if held else 1)


if __name__ == "__main__":
    main()
