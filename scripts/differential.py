"""Differential run of two commits over the same scenarios: exit codes, reports, DESTs' bytes, manifests.

For a refactor that must change no behaviour (issue 14's, issue 26's): each commit is checked
out into a temporary worktree and runs every scenario against one emulator and the same local
trees, under ``mpiexec``; what each leaves is compared. Time-dependent fields (stage seconds,
timelines, rates, peak memory, the download workers' split) are left out of the comparison.

    python scripts/differential.py OLD_COMMIT [NEW_COMMIT]   # NEW: the working tree's HEAD

Exit status 0 when every scenario matches; otherwise the differences, one per line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from azcp_cluster.devtools import azurite  # noqa: E402
from azcp_cluster.devtools.datasets import pseudo_random, tricky_tree, with_traps  # noqa: E402

MiB = 1 << 20
# Report fields that depend on timing or on the machine, not on behaviour. A streaming leader
# sends a block from the download's buffers if they still hold it when its transfer comes:
# sent_from_memory_bytes differs between two runs of one commit.
TIMING = {
    "timeline",
    "timeline_origin",
    "download_rate",
    "peak_rss_bytes",
    "worker_bytes_by_rank",
    "sent_from_memory_bytes",
}


def scenarios(emu: azurite.Emulator, local: Path) -> list[tuple[str, int, list[str]]]:
    """(name, ranks, arguments with DEST as {dest}); each runs twice (the second a rerun)."""
    url = emu.url("diff", "ckpt")
    return [
        ("blob-defaults", 4, [url, "{dest}/{rank}"]),
        ("blob-sharded-verify", 4, [url, "{dest}/{rank}", "--shard-size", "1MiB", "--block-size", "256KiB",
                                    "--bcast-chunk", "384KiB", "--verify"]),
        ("blob-two-phase", 2, [url, "{dest}/{rank}", "--no-overlap", "--compare", "etag"]),
        ("blob-one-node", 3, [url, "{dest}/one", "--shard-size", "1MiB"]),
        ("blob-dry-run", 2, [url, "{dest}/{rank}", "--dry-run"]),
        ("blob-missing-prefix", 2, [emu.url("diff", "nothing-here"), "{dest}/{rank}"]),
        ("blob-missing-container", 2, [emu.url("no-such-container"), "{dest}/{rank}"]),
        ("local-three", 3, [str(local), "{dest}/{rank}", "--bcast-chunk", "1MiB", "--verify", "stream"]),
        ("local-filtered", 2, [str(local), "{dest}/{rank}", "--include", "*.bin", "--exclude", "d/*"]),
    ]  # fmt: skip


def tree(root: Path) -> dict[str, Any]:
    """Every file below ``root``: bytes (as a digest) or, for the manifest, its normalised JSON."""
    import hashlib

    out: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        rel = path.relative_to(root).as_posix()
        if path.name == ".azcp-manifest.json":
            out[rel] = json.loads(path.read_text())
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def normalised(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its timing; stage figures reduced to their bytes."""
    doc = {k: v for k, v in report.items() if k not in TIMING}
    doc["stages"] = {name: figures.get("bytes") for name, figures in report.get("stages", {}).items()}
    return doc


def run(commit_dir: Path, name: str, ranks: int, args: list[str], work: Path, env: dict[str, str]) -> dict[str, Any]:
    """One scenario, run and rerun, with the code of ``commit_dir``: what it leaves."""
    dest = work / name
    results = []
    for attempt in ("first", "rerun"):
        report = work / f"{name}-{attempt}.json"
        dests = [a.replace("{dest}", str(dest)) for a in args]
        cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "azcp_cluster", *dests, "--json", str(report),
               "--no-progress"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=commit_dir, env={**env, "PYTHONPATH": str(commit_dir)},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        stdout = [line.split(" T=")[0] for line in proc.stdout.splitlines()]  # the lines without their times
        errors = [line for line in proc.stderr.splitlines() if line.startswith("azcp-cluster: error")]
        doc = normalised(json.loads(report.read_text())) if report.exists() else None
        results.append({"exit": proc.returncode, "stdout": stdout, "errors": errors, "report": doc,
                        "dest": tree(dest) if dest.exists() else None})  # fmt: skip
    return {"first": results[0], "rerun": results[1]}


def differences(a: Any, b: Any, where: str) -> list[str]:
    """Where ``a`` and ``b`` differ, as paths."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += differences(a.get(key, "<missing>"), b.get(key, "<missing>"), f"{where}.{key}")
        return out
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def main(argv: list[str]) -> int:
    """Run every scenario with both commits and print the differences."""
    old = argv[0]
    new = argv[1] if len(argv) > 1 else "HEAD"
    base = Path(tempfile.mkdtemp(prefix="azcp-diff-"))
    trees = {}
    try:
        for label, commit in (("old", old), ("new", new)):
            trees[label] = base / label
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[label]), commit],
                           check=True, capture_output=True)  # fmt: skip
        local = base / "source"
        for rel, data in {"a.bin": pseudo_random(3 * MiB + 7, "d-a"), "d/b.bin": pseudo_random(MiB, "d-b"),
                          "d/e/c.txt": b"c" * 100, "empty": b""}.items():  # fmt: skip
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            (local / rel).write_bytes(data)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI", "SLURM", "AZURE", "AZCP"))}
        with azurite.running() as emu:
            azurite.upload(emu, "diff", with_traps(tricky_tree("ckpt", chunk=MiB, block=4 * MiB), "ckpt"))
            env.update(emu.key_env())
            found: list[str] = []
            for name, ranks, args in scenarios(emu, local):
                got = {label: run(trees[label], name, ranks, args, base / f"work-{label}", env) for label in trees}
                diff = differences(got["old"], got["new"], name)
                codes = f"exit {got['new']['first']['exit']}, rerun {got['new']['rerun']['exit']}"
                print(f"{name}: {'same' if not diff else f'{len(diff)} differences'} ({codes})", flush=True)
                found += diff
        for line in found:
            print(line)
        return 1 if found else 0
    finally:
        for path in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
