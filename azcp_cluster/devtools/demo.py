"""The README's demo: a staging run to 4 copies (4 ranks, each its own DEST) from a local emulator, end to end.

Starts Azurite on loopback, uploads a generated checkpoint-like dataset, prints the command and
runs it (``mpiexec -n 4 azcp-cluster SOURCE '/tmp/.../node{rank}'``), runs it again to show
that nothing moves the second time, checks the four copies, removes everything it made (or,
with ``--keep``, leaves the copies and the emulator serving its data, and says how to run the
command again, stop the emulator and remove the rest), and ends with the same command for
your own storage account.

The command printed is the one run, argument for argument; the credential goes in the
environment (``AZURE_STORAGE_CONNECTION_STRING``, the emulator's well-known development
account), which the demo names and does not print.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from azcp_cluster.core.config import format_bytes, parse_size
from azcp_cluster.core.naming import MANIFEST_NAME
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random

# The variable the demo sets for the tool; the value (the emulator's connection string) is not printed.
CREDENTIAL_VARIABLE = "AZURE_STORAGE_CONNECTION_STRING"
# With --keep: the file in the work directory that exports it, for running the printed command again.
ENV_FILE = "emulator.env"
# The closing example's storage account (made up, real-looking).
OWN_ACCOUNT_URL = "https://mystorageacct.blob.core.windows.net"
# The small files of checkpoint_like(), about: the rest of the size goes to the four shards.
_SMALL_FILES_BYTES = 300_000 + 20 * 15_000


def checkpoint_like(total: int) -> dict[str, bytes]:
    """A small model-checkpoint-shaped dataset of about ``total`` bytes: four big shards and some small files."""
    big = max(1, (total - _SMALL_FILES_BYTES) // 4)
    blobs = {
        f"llama-tiny/model-{i:05d}-of-00004.safetensors": pseudo_random(big + i * 4099, f"shard{i}") for i in range(4)
    }
    blobs["llama-tiny/config.json"] = b'{"hidden_size": 64, "num_layers": 2}\n'
    blobs["llama-tiny/tokenizer/tokenizer.json"] = pseudo_random(300_000, "tok")
    blobs["llama-tiny/empty.txt"] = b""
    for i in range(20):
        blobs[f"llama-tiny/extra/part-{i:02d}.bin"] = pseudo_random(10_000 + i * 513, f"x{i}")
    return blobs


class _Failed(Exception):
    """A copy that differs from the source (raised inside the emulator's block, so that it stops)."""


def _digest(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (shorter to read, the same file)."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") and rel != "." else path


def programs() -> tuple[str, str]:
    """The ``mpiexec`` and ``azcp-cluster`` the demo runs: this environment's own, else the ones on PATH.

    Named by a path with a slash where one exists, so the printed command runs the same programs
    whatever PATH is when it is pasted.
    """
    bindir = Path(sys.executable).parent
    found = []
    for name in ("mpiexec", "azcp-cluster"):
        path = bindir / name
        found.append(_shown(str(path)) if os.access(path, os.X_OK) else (shutil.which(name) or name))
    return found[0], found[1]


def stage_command(mpiexec: str, tool: str, ranks: int, source: str, dest: str) -> list[str]:
    """The demo's command, as run: the README's, with nothing added."""
    return [mpiexec, "-n", str(ranks), tool, source, dest]


def next_step(mpiexec: str, tool: str, ranks: int) -> list[str]:
    """The closing lines: the same command on the user's own storage account and container."""
    own = stage_command(mpiexec, tool, ranks, f"{OWN_ACCOUNT_URL}/models/llama-70b", "/mnt/nvme/llama-70b")
    return [
        "== next: the same command on your own storage account, container and prefix (here mystorageacct, models,",
        "   llama-70b), with your Azure CLI login (role 'Storage Blob Data Reader' on the account or the container):",
        "   az login    # or, without az: export AZURE_STORAGE_SAS_TOKEN='sv=...&sp=rl&sig=...' (a SAS: read, list)",
        f"   {shlex.join(own)}",
        "   On a cluster, one rank per node: srun --ntasks-per-node=1 azcp-cluster ... (examples/slurm, examples/aks);",
        "   every option, credential and exit code: README.md, docs/usage.md.",
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="96MiB", help="dataset size to generate (default 96MiB)")
    parser.add_argument(
        "-n", "--ranks", type=int, default=4, help="MPI ranks, each writing its own copy (DEST node{rank})"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the copies and the emulator's data, and leave the emulator running, "
        "so the printed command can be run again (the demo says where they are and how to stop it)",
    )
    return parser


def _check_copies(work: Path, ranks: int, blobs: dict[str, bytes]) -> int:
    """Raise :class:`_Failed` unless every copy holds the dataset; the number of files."""
    expected = {name[len("llama-tiny/") :]: hashlib.md5(data).hexdigest() for name, data in blobs.items()}
    for rank in range(ranks):
        node = work / f"node{rank}"
        got = {
            p.relative_to(node).as_posix(): _digest(p)
            for p in node.rglob("*")
            if p.is_file() and p.name != MANIFEST_NAME  # the tool's own record of the copy
        }
        if got != expected:
            raise _Failed(f"node{rank}: copy differs from the source")
    return len(expected)


def _write_env_file(work: Path, emu: azurite.Emulator) -> Path:
    """The file that exports the emulator's connection string, for the command run again by hand."""
    env_file = work / ENV_FILE
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"export {CREDENTIAL_VARIABLE}={shlex.quote(emu.connection_string)}\n")
    return env_file


def _say_kept(
    work: Path, ranks: int, emu: azurite.Emulator, emulator_data: Path | None, cmd: list[str], env_file: Path
) -> None:
    """Where --keep left the copies and the emulator, and how to run the command again."""
    print(f"== kept (--keep), in {work}:")
    print(f"   the copies: {work}/node0 .. node{ranks - 1}")
    print(f"   the emulator's data: {emulator_data}; the emulator still serves it on {emu.host}:{emu.port}")
    print(f"   the command again, from {os.getcwd()} (nothing moves; remove a copy and it is made anew):")
    print(f"   . {shlex.quote(str(env_file))}    # exports {CREDENTIAL_VARIABLE}")
    print(f"   {shlex.join(cmd)}")
    print(f"   stop the emulator: kill {emu.pid}")
    print(f"   remove everything: rm -rf {shlex.quote(str(work))}")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when all the copies are identical to the source."""
    args = _parser().parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="azcp-demo-"))
    dest = str(work / "node{rank}")
    print(
        f"== azcp-cluster demo: a generated checkpoint-like dataset of about {format_bytes(parse_size(args.size))} "
        "goes from a local Azure "
        # "copies", the word of the report's [cluster] line: ranks on one host, each its own DEST, stand for nodes.
        f"Storage emulator (Azurite) to {args.ranks} copies ({dest}: one per rank, as {args.ranks} nodes would each "
        "hold one), with one MPI job, run twice",
        flush=True,
    )
    mpiexec, tool = programs()
    blobs = checkpoint_like(parse_size(args.size))
    kept = False
    try:
        emulator_data = work / "azurite" if args.keep else None
        if emulator_data is not None:
            emulator_data.mkdir()
        with azurite.running(location=str(emulator_data) if emulator_data else None, leave_running=args.keep) as emu:
            print(
                f"== emulator on {emu.host}:{emu.port}; uploading {len(blobs)} blobs "
                f"({format_bytes(sum(map(len, blobs.values())))}) to its container 'models'",
                flush=True,
            )
            azurite.upload(emu, "models", blobs)
            source = emu.url("models", "llama-tiny")
            cmd = stage_command(mpiexec, tool, args.ranks, source, dest)
            env = {**os.environ, CREDENTIAL_VARIABLE: emu.connection_string}
            print(
                f"== the command (the demo sets {CREDENTIAL_VARIABLE} to the emulator's well-known development "
                "account, not printed here):",
                flush=True,
            )
            print(f"   {shlex.join(cmd)}", flush=True)
            for attempt in ("first run", "second run, the same command (already staged: nothing moves)"):
                print(f"== {attempt}", flush=True)
                subprocess.run(cmd, env=env, check=True)
            files = _check_copies(work, args.ranks, blobs)
            print(f"== all {args.ranks} copies are identical to the source ({files} files)")
            if args.keep:
                env_file = _write_env_file(work, emu)
                kept = True
                _say_kept(work, args.ranks, emu, emulator_data, cmd, env_file)
            else:
                print(f"== removing {work} and stopping the emulator (--keep keeps them)")
        print("\n".join(next_step(mpiexec, tool, args.ranks)))
        return 0
    except (subprocess.CalledProcessError, _Failed) as exc:
        failed = f"azcp-cluster exited with {exc.returncode}" if isinstance(exc, subprocess.CalledProcessError) else exc
        print(f"== {failed}", file=sys.stderr)
        if args.keep:  # the emulator has stopped (the block raised); what the run left stays, to look at
            kept = True
            print(f"== kept (--keep): {work}; the emulator is stopped", file=sys.stderr)
        return exc.returncode or 1 if isinstance(exc, subprocess.CalledProcessError) else 1
    finally:
        if not kept:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
