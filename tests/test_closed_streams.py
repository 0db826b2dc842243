"""A standard stream closed at start-up (``2>&-``, ``1>&-``, ``0<&-``) is /dev/null: the copy completes, exit 0.

cron and daemon wrappers may start a command with one of fd 0, 1, 2 closed. Python then sets
``sys.stdin`` / ``sys.stdout`` / ``sys.stderr`` to None, and the next file opened takes the free
number. Before this was handled, a closed stderr ended the run with exit 1 ("internal error",
an AttributeError in the progress lines, the copy left under temporary names), and with
``--progress none`` the copy completed, its JSON said 0, and the process exited 1 all the same.

Both entry points reopen a closed one onto /dev/null: ``bin/azcp-cluster`` (the shell wrapper,
before the interpreter starts) and ``cli.main`` (``python -m azcp_cluster``, a host program).

Under ``mpiexec`` the ranks' streams are the launcher's pipes, never closed; closing
``mpiexec``'s own makes MPICH's hydra (5.0.2) exit 255 before it starts any rank ("fcntl failed
on 1"), which nothing of the tool can change (Open MPI 4.1.4's ``mpirun`` runs the copy: see
docs/troubleshooting.md, "The container image"). So the ``mpiexec`` runs close each rank's stream
the way a per-rank wrapper would: ``mpiexec -n 2 sh -c 'exec "$0" "$@" 2>&-' python -m ...``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import REPO, clean_env, mpiexec_path, tree_of

FILES = {
    "big.bin": pseudo_random(3 * MiB + 123, "closed-big"),
    "dir/small.txt": b"a small file\n",
    "dir/mid.bin": pseudo_random(MiB // 2, "closed-mid"),
}
# The shell redirections under test, each applied by `sh -c 'exec "$0" "$@" REDIRECTION'`.
CLOSED = {"stdin": "0<&-", "stdout": "1>&-", "stderr": "2>&-"}
TIMEOUT = 120


@pytest.fixture(scope="module")
def container(emulator: azurite.Emulator) -> str:
    name = "closed" + uuid.uuid4().hex[:12]
    azurite.upload(emulator, name, FILES)
    return name


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's ``bin/azcp-cluster`` beside this environment's ``azcp-cluster-py``.

    Not the copy pip put into the environment's bin/ at install time: that one is the wrapper as it
    was then, and the wrapper under test is the repository's.
    """
    tool = Path(sys.executable).parent / "azcp-cluster-py"
    assert tool.exists(), f"{tool} missing: install the package (scripts/bootstrap.sh)"
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "azcp-cluster").write_bytes((REPO / "bin" / "azcp-cluster").read_bytes())
    (bin_dir / "azcp-cluster").chmod(0o755)
    (bin_dir / "azcp-cluster-py").symlink_to(tool)
    return bin_dir / "azcp-cluster"


def _closing(redirection: str, command: list[str]) -> list[str]:
    """``command`` started with one standard stream closed, as cron or a daemon wrapper would."""
    return ["sh", "-c", f'exec "$0" "$@" {redirection}', *command]


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=clean_env(env), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT
    )


@pytest.mark.parametrize("stream", sorted(CLOSED))
@pytest.mark.parametrize("entry", ["wrapper", "python", "mpiexec"])
def test_a_closed_standard_stream_is_dev_null_and_the_copy_completes(
    emulator: azurite.Emulator, container: str, wrapper: Path, tmp_path: Path, entry: str, stream: str
) -> None:
    report = tmp_path / "report.json"
    # The progress left at its default (auto: status lines, where stderr is no terminal): the
    # lines are written to the closed stream. Small blocks: several lines' worth of pieces.
    args = [emulator.url(container), str(tmp_path / "d" / "{rank}"), "--block-size", "1MiB", "--json", str(report)]
    python = [sys.executable, "-m", "azcp_cluster"]
    if entry == "wrapper":
        cmd, ranks = _closing(CLOSED[stream], [str(wrapper), *args]), 1
    elif entry == "python":
        # Two download workers: processes of their own, which inherit the rank's standard streams.
        cmd, ranks = _closing(CLOSED[stream], [*python, *args, "--download-workers", "2"]), 1
    else:
        cmd, ranks = [mpiexec_path(), "-n", "2", *_closing(CLOSED[stream], [*python, *args])], 2
    result = _run(cmd, emulator.key_env())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output and "error" not in output, output
    for rank in range(ranks):
        assert tree_of(tmp_path / "d" / str(rank)) == FILES, f"rank {rank}: not the complete copy\n{output}"
    doc = json.loads(report.read_text())
    assert doc["exit_code"] == 0 and doc.get("error") is None, doc
    # What went to the closed stream went to /dev/null; the others carry on as ever.
    assert (result.stdout == "") if stream == "stdout" else ("[list] 3 files" in result.stdout), output
    if stream == "stderr":
        assert result.stderr == "", output


def test_with_progress_none_a_closed_stderr_exits_0(
    emulator: azurite.Emulator, container: str, wrapper: Path, tmp_path: Path
) -> None:
    # Here the copy always completed; the exit status was 1 (the final flush of a None stderr).
    report = tmp_path / "report.json"
    args = [emulator.url(container), str(tmp_path / "d"), "--progress", "none", "--json", str(report)]
    result = _run(_closing("2>&-", [str(wrapper), *args]), emulator.key_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert tree_of(tmp_path / "d") == FILES
    assert json.loads(report.read_text())["exit_code"] == 0


# -- what each entry point does, on its own ----------------------------------------------------------

# Written by the program that stands in for the tool: which of fds 0-2 it found open, on what,
# whether Python gave it None for sys.stdin / stdout / stderr, and the fd a file opened now gets.
PROBE = """
import os, sys
{prepare}
links = {{fd: f"/proc/self/fd/{{fd}}" for fd in (0, 1, 2)}}
fds = {{fd: os.readlink(link) if os.path.exists(link) else None for fd, link in links.items()}}
seen = (fds, [s is None for s in (sys.stdin, sys.stdout, sys.stderr)], os.open(os.devnull, os.O_RDONLY),
        [os.get_inheritable(fd) for fd in (0, 1, 2) if fds[fd]])
print(repr(seen), file=open(os.environ["PROBE_OUT"], "w"))
"""


def _probe(tmp_path: Path, cmd: list[str]) -> tuple[dict[int, str | None], list[bool], int, list[bool]]:
    out = tmp_path / "probe.out"
    subprocess.run(cmd, env={**os.environ, "PROBE_OUT": str(out)}, timeout=60, check=True)
    fds, nones, opened, inheritable = ast.literal_eval(out.read_text())
    return fds, nones, opened, inheritable


@pytest.mark.parametrize("redirection", [*CLOSED.values(), "0<&- 1>&- 2>&-"])
def test_the_wrapper_starts_the_interpreter_with_closed_streams_on_dev_null(tmp_path: Path, redirection: str) -> None:
    # The wrapper with a stand-in for the tool beside it, which only looks at what it was given.
    (tmp_path / "azcp-cluster").write_bytes((REPO / "bin" / "azcp-cluster").read_bytes())
    (tmp_path / "azcp-cluster-py").write_text(f"#!{sys.executable}\n" + PROBE.format(prepare=""))
    for name in ("azcp-cluster", "azcp-cluster-py"):
        (tmp_path / name).chmod(0o755)
    fds, nones, opened, inheritable = _probe(tmp_path, _closing(redirection, [str(tmp_path / "azcp-cluster")]))
    closed = {int(part[0]) for part in redirection.split()}
    for fd in closed:
        assert fds[fd] == os.devnull, fds
    assert all(path is not None for path in fds.values()), fds
    assert nones == [False, False, False]  # Python found all three open
    assert opened > 2 and all(inheritable)


@pytest.mark.parametrize("redirection", [*CLOSED.values(), "0<&- 1>&- 2>&-"])
def test_main_reopens_closed_streams_before_anything_else(tmp_path: Path, redirection: str) -> None:
    # What cli.main does first, in an interpreter started with the streams closed (python -m azcp_cluster).
    prepare = "from azcp_cluster import cli; cli._reopen_closed_streams()"
    cmd = _closing(redirection, [sys.executable, "-c", PROBE.format(prepare=prepare)])
    fds, nones, opened, inheritable = _probe(tmp_path, cmd)
    closed = {int(part[0]) for part in redirection.split()}
    for fd in closed:
        assert fds[fd] == os.devnull, fds
    assert nones == [False, False, False]
    assert opened > 2, "a file opened later took a standard stream's number"
    assert all(inheritable), "the download workers would start with the stream closed again"
