"""The README's demo: a 4-"node" staging run against a local emulator, end to end.

Starts Azurite on loopback, uploads a generated checkpoint-like dataset, runs
``mpiexec -n 4 azcp-cluster SOURCE '/tmp/.../node{rank}'``, checks the four copies,
reruns to show that nothing moves the second time, and removes everything it made.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from azcp_cluster.config import MiB, parse_size
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.naming import MANIFEST_NAME


def checkpoint_like(total: int) -> dict[str, bytes]:
    """A small model-checkpoint-shaped dataset: a few big shards and some small files."""
    big = max(1, total // 6)
    blobs = {
        f"llama-tiny/model-{i:05d}-of-00004.safetensors": pseudo_random(big + i * 4099, f"shard{i}") for i in range(4)
    }
    blobs["llama-tiny/config.json"] = b'{"hidden_size": 64, "num_layers": 2}\n'
    blobs["llama-tiny/tokenizer/tokenizer.json"] = pseudo_random(300_000, "tok")
    blobs["llama-tiny/empty.txt"] = b""
    for i in range(20):
        blobs[f"llama-tiny/extra/part-{i:02d}.bin"] = pseudo_random(10_000 + i * 513, f"x{i}")
    return blobs


def _digest(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when all four copies are identical to the source."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="96MiB", help="dataset size to generate (default 96MiB)")
    parser.add_argument("-n", "--ranks", type=int, default=4, help="MPI ranks, one per simulated node")
    args = parser.parse_args(argv)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or "mpiexec"
    blobs = checkpoint_like(parse_size(args.size))
    work = Path(tempfile.mkdtemp(prefix="azcp-demo-"))
    try:
        with azurite.running() as emu:
            print(
                f"== emulator on {emu.host}:{emu.port}; uploading {len(blobs)} blobs "
                f"({sum(map(len, blobs.values())) / MiB:.1f} MiB)",
                flush=True,
            )
            azurite.upload(emu, "models", blobs)
            source = emu.url("models", "llama-tiny")
            dest = str(work / "node{rank}")
            cmd = [
                mpiexec,
                "-n",
                str(args.ranks),
                sys.executable,
                "-m",
                "azcp_cluster",
                source,
                dest,
                "--shard-size",
                "8MiB",
                "--json",
                str(work / "report.json"),
            ]
            env = {**os.environ, **emu.key_env()}
            for attempt in ("first run", "second run (already staged: nothing moves)"):
                print(f"== {attempt}: mpiexec -n {args.ranks} azcp-cluster {source} '{dest}'", flush=True)
                subprocess.run(cmd, env=env, check=True)
            expected = {name[len("llama-tiny/") :]: hashlib.md5(data).hexdigest() for name, data in blobs.items()}
            for rank in range(args.ranks):
                node = work / f"node{rank}"
                got = {
                    p.relative_to(node).as_posix(): _digest(p)
                    for p in node.rglob("*")
                    if p.is_file() and p.name != MANIFEST_NAME  # the tool's own record of the copy
                }
                if got != expected:
                    print(f"== node{rank}: copy differs from the source", file=sys.stderr)
                    return 1
            print(f"== all {args.ranks} node directories hold identical copies of the {len(expected)} files")
        return 0
    except subprocess.CalledProcessError as exc:
        print(f"== azcp-cluster exited with {exc.returncode}", file=sys.stderr)
        return exc.returncode or 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
