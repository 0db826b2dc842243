"""Listing at scale, against the emulator: the lean listing (bloblist.py) and the SDK's, same run.

    python -m benchmarks.listing [--blobs 100000] [--dirs 100] [--repeats 3] [--json FILE]

Uploads ``--blobs`` tiny blobs once into ``--dirs`` virtual directories of one container of
an in-memory Azurite (threads: the upload takes a minute or two), then lists the container
``--repeats`` times each way, alternating, and checks that the two listings are identical
(names, sizes, ETags, MD5s, times); and the tool's own list stage with 4 ranks (a
``--dry-run`` under ``mpiexec -n 4``: its ``[list]`` line), also alternating. Then the no-op
rerun the tool promises for every job
script: 1,000 blobs copied once by 4 ranks, then the same command again, its ``[list]`` and
``[total]`` lines read, ``--repeats`` times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from azcp_cluster.config import Config
from azcp_cluster.credentials import Authorizer, resolve_credential
from azcp_cluster.devtools import azurite
from azcp_cluster.listing import list_source, list_with_sdk
from azcp_cluster.source import parse_blob_url


def _upload(emulator: azurite.Emulator, container: str, blobs: int, dirs: int) -> None:
    client = azurite.container_client(emulator, container)

    def one(i: int) -> None:
        client.upload_blob(f"train/part-{i % dirs:04d}/sample-{i:08d}.bin", b"x" * (i % 97), overwrite=True)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(blobs)))


def _time_listings(emulator: azurite.Emulator, container: str, repeats: int) -> dict[str, Any]:
    url = emulator.url(container)
    source = parse_blob_url(url)
    auth = Authorizer(source, resolve_credential(source, emulator.key_env(), "auto"), time.time)
    cfg = Config(source=url, dest="/tmp/unused")
    times: dict[str, list[float]] = {"lean": [], "sdk": []}
    results = {}
    for _ in range(repeats):
        for name, lister in (("sdk", list_with_sdk), ("lean", list_source)):
            started = time.perf_counter()
            results[name] = lister(source, auth, cfg)
            times[name].append(time.perf_counter() - started)
    assert results["lean"] == results["sdk"], "the two listings differ"
    lean, sdk = statistics.median(times["lean"]), statistics.median(times["sdk"])
    return {
        "files": len(results["lean"].files),
        "lean_s": [round(t, 3) for t in times["lean"]],
        "sdk_s": [round(t, 3) for t in times["sdk"]],
        "lean_over_sdk": round(lean / sdk, 3),
        "identical": True,
    }


def _ranks_listing(emulator: azurite.Emulator, container: str, repeats: int, ranks: int = 4) -> list[float]:
    """The ``[list]`` time of a dry run of the whole container with ``ranks`` ranks."""
    seconds = []
    env = {**os.environ, **emulator.key_env()}
    with tempfile.TemporaryDirectory() as scratch:
        cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "azcp_cluster", emulator.url(container),
               f"{scratch}/d/{{rank}}", "--no-progress", "--dry-run"]  # fmt: skip
        for _ in range(repeats):
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            seconds.append(float(re.search(r"\[list\] .* T=([\d.]+)s", out).group(1)))  # type: ignore[union-attr]
    return seconds


def _noop_rerun(emulator: azurite.Emulator, repeats: int) -> dict[str, Any]:
    container = "rerun" + uuid.uuid4().hex[:10]
    _upload(emulator, container, 1000, 10)
    with tempfile.TemporaryDirectory() as scratch:
        cmd = ["mpiexec", "-n", "4", sys.executable, "-m", "azcp_cluster", emulator.url(container),
               f"{scratch}/d/{{rank}}", "--no-progress"]  # fmt: skip
        env = {**os.environ, **emulator.key_env()}
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        totals, lists, walls = [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            walls.append(time.perf_counter() - started)
            assert "0 to transfer" in out, out
            totals.append(float(re.search(r"\[total\] T=([\d.]+)s", out).group(1)))  # type: ignore[union-attr]
            lists.append(float(re.search(r"\[list\] .* T=([\d.]+)s", out).group(1)))  # type: ignore[union-attr]
    return {"blobs": 1000, "ranks": 4, "total_s": totals, "list_s": lists, "wall_s": [round(w, 2) for w in walls]}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print (and with --json write) its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blobs", type=int, default=100_000)
    parser.add_argument("--dirs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {"blobs": args.blobs, "dirs": args.dirs}
    with azurite.running() as emulator:
        container = "scale" + uuid.uuid4().hex[:10]
        started = time.perf_counter()
        _upload(emulator, container, args.blobs, args.dirs)
        figures["upload_s"] = round(time.perf_counter() - started, 1)
        figures["listing"] = _time_listings(emulator, container, args.repeats)
        four = _ranks_listing(emulator, container, args.repeats)
        sdk = statistics.median(figures["listing"]["sdk_s"])
        figures["listing"]["four_ranks_list_s"] = four
        figures["listing"]["four_ranks_over_sdk"] = round(statistics.median(four) / sdk, 3)
        figures["noop_rerun"] = _noop_rerun(emulator, args.repeats)
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
