"""The README's demo command runs end to end (a smaller dataset, the same code path).

It prints the command it runs, argument for argument (the credential by its variable's name
only), ends with the same command for the user's own storage account, and ``--keep`` keeps
what it says it keeps: the printed lines, pasted into a shell, run the command again and stop
the emulator.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from azcp_cluster.core.naming import MANIFEST_NAME
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.devtools import azurite, demo
from tests.conftest import MPI_TIMEOUT, clean_env

FILES = 27  # checkpoint_like(): 4 shards, config, tokenizer, empty.txt, 20 extra parts
NOTHING_MOVED = f"[diff] 0 to transfer (0 peer, 0 azure), {FILES} skipped"


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _printed_command(out: str) -> list[str]:
    """The command the demo says it runs: the indented line after '== the command'."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("== the command"))
    assert demo.CREDENTIAL_VARIABLE in lines[at]  # the credential, by name
    return shlex.split(lines[at + 1])


def _after(out: str, label: str) -> str:
    """The rest of the one line that contains ``label``."""
    (line,) = [line for line in out.splitlines() if label in line]
    return line.split(label, 1)[1].strip()


def _no_secret(text: str) -> None:
    assert azurite.ACCOUNT_KEY not in text
    assert "AccountKey=" not in text


def test_demo_stages_four_copies_prints_its_command_and_ends_with_the_next_step() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "azcp_cluster.devtools.demo", "--size", "6MiB"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    _no_secret(out + proc.stderr)
    lines = out.splitlines()
    # The first line says what is about to happen, before the dataset is made and the emulator starts.
    assert lines[0].startswith("== azcp-cluster demo: "), lines[0]
    assert lines[1].startswith("== emulator on ")
    assert NOTHING_MOVED in out  # the rerun moved nothing
    assert "all 4 copies are identical to the source" in out
    # One word for a rank's own DEST, in the banner and in the report's [cluster] line: "copies", not "nodes".
    assert " to 4 copies (" in lines[0] and "nodes" not in lines[0].split("(")[0], lines[0]
    assert "[cluster] 4 ranks on 1 host, 4 copies, 4 downloading" in out, out

    cmd = _printed_command(out)
    mpiexec, n, ranks, tool, source, dest = cmd  # the README's command: nothing added
    assert (Path(mpiexec).name, n, ranks, Path(tool).name) == ("mpiexec", "-n", "4", "azcp-cluster")
    emulator = _after(out, "== emulator on ").split(";")[0]
    assert source == f"http://{emulator}/{azurite.ACCOUNT}/models/llama-tiny"
    assert dest.endswith("/node{rank}")
    # Removed: the copies and the emulator.
    work = Path(dest).parent
    assert work.name.startswith("azcp-demo-") and not work.exists()
    host, port = emulator.rsplit(":", 1)
    assert not _listening(host, int(port))

    # It ends with the same command for the user's own account, and how to sign in.
    ending = demo.next_step(mpiexec, tool, 4)
    assert lines[-len(ending) :] == ending
    text = "\n".join(ending)
    assert "az login" in text and "AZURE_STORAGE_SAS_TOKEN" in text and "sp=rl" in text
    (own_line,) = [line for line in ending if demo.OWN_ACCOUNT_URL in line]
    own = shlex.split(own_line)
    assert own[:4] == cmd[:4]  # the same programs, the same ranks
    theirs = parse_blob_url(own[4])  # a URL the tool takes
    assert (theirs.account, theirs.container, theirs.prefix) == ("mystorageacct", "models", "llama-70b")


@pytest.mark.slow  # about 5 s: CI's slow step (the other demo test runs in the default suite)
def test_demo_runs_exactly_the_printed_command_and_keep_keeps_what_it_says(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    env = clean_env()
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    runs: list[tuple[list[str], dict[str, str]]] = []
    real_run = subprocess.run

    def recording_run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        if sys._getframe(1).f_globals["__name__"] == demo.__name__:  # what the demo itself runs
            runs.append((list(args), dict(kwargs["env"])))
        return real_run(args, **kwargs)

    monkeypatch.setattr(demo.subprocess, "run", recording_run)
    pid = None
    work = None
    try:
        rc = demo.main(["--size", "6MiB", "--keep"])
        out = capfd.readouterr().out
        assert rc == 0, out
        _no_secret(out)
        pid = int(_after(out, "stop the emulator: kill "))
        work = Path(_after(out, "== kept (--keep), in ").rstrip(":"))

        # What ran is what was printed, twice; its environment differs from the demo's by the one named variable.
        printed = _printed_command(out)
        assert [args for args, _ in runs] == [printed, printed]
        for _, run_env in runs:
            assert {k for k in run_env.keys() | env.keys() if env.get(k) != run_env.get(k)} == {
                demo.CREDENTIAL_VARIABLE
            }

        # Kept: the four copies, the emulator's data, and the emulator itself, serving them.
        for rank in range(4):
            node = work / f"node{rank}"
            assert len([p for p in node.rglob("*") if p.is_file() and p.name != MANIFEST_NAME]) == FILES
        data = Path(_after(out, "the emulator's data: ").split(";")[0])
        assert data == work / "azurite" and any(data.iterdir())
        host, port = _after(out, "the emulator still serves it on ").rsplit(":", 1)
        assert _listening(host, int(port))
        env_file = work / demo.ENV_FILE
        assert env_file.stat().st_mode & 0o777 == 0o600

        # The printed lines, pasted into a shell: the same command again, and nothing moves.
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f". {env_file}"))
        assert shlex.split(lines[at + 1]) == printed
        again = real_run(
            ["bash", "-c", f"{lines[at].strip()}\n{lines[at + 1].strip()}"],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=MPI_TIMEOUT,
        )
        assert again.returncode == 0, again.stdout + again.stderr
        assert NOTHING_MOVED in again.stdout

        # The printed ways to stop the emulator and remove the rest do that.
        stop = real_run(["bash", "-c", f"kill {pid}"], capture_output=True, text=True)
        assert stop.returncode == 0, stop.stderr
        deadline = time.monotonic() + 20
        while _listening(host, int(port)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _listening(host, int(port))
        pid = None
        remove = real_run(["bash", "-c", _after(out, "remove everything: ")], capture_output=True, text=True)
        assert remove.returncode == 0 and not work.exists(), remove.stderr
        assert re.search(r"^== next: ", out, re.MULTILINE)
    finally:
        if pid is not None:
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
