"""The sample report lines of the docs are what the tool prints: each one matched against a real run's.

A sample is a fenced block of README.md or docs/*.md whose every line starts with a report line's tag
(``[cluster] ``, ``[list] ``, ...). Each of its lines must match, numbers and binary units wildcarded,
a line that real runs printed: small copies on Azurite to two "nodes" (``mpiexec -n 2``, DEST
``node{rank}``): from a blob prefix through a proxy that answers one ranged GET with a 503 (the only
fake: a retry the emulator cannot be made to ask for), with ``--verify``; its no-op rerun; a dry run;
and from a local SOURCE. A sample whose words drifted from the code's (a ``[bcast]`` line without
its ``via chain (…)``) fails.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.faultproxy import FaultProxy, Rule
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TAGS = ("cluster", "list", "diff", "download", "bcast", "verify", "total", "plan", "dry-run")
# A report line: a stage's tag, the summary line, or a dry run's line for a file.
TAGGED = re.compile(
    r"\[(?:" + "|".join(TAGS) + r")\] |azcp-cluster: (?!error|warning|notice)|(?:new|peer|resume|skip|delete) +\d"
)
# A number, or a binary unit after a space (not the B of BW=): each matches any of its kind.
TOKEN = re.compile(r"\d+(?:\.\d+)?|(?<= )(?:B|KiB|MiB|GiB|TiB)\b")
ANY_NUMBER = r"\d+(?:\.\d+)?"
ANY_UNIT = "(?:B|KiB|MiB|GiB|TiB)"


def samples() -> list[tuple[str, str]]:
    """(page, line) for every line of every fenced block made only of report lines."""
    found = []
    for page in PAGES:
        for block in re.findall(r"(?ms)^```[a-z]*\n(.*?)^```", page.read_text(encoding="utf-8")):
            lines = [line.rstrip() for line in block.splitlines() if line.strip()]
            if lines and all(TAGGED.match(line) for line in lines):
                found += [(page.name, line) for line in lines]
    return found


def pattern(line: str) -> re.Pattern[str]:
    """The line as a regular expression: each number any number, each binary unit any unit, the rest as is."""
    parts, pos = [], 0
    for token in TOKEN.finditer(line):
        parts += [re.escape(line[pos : token.start()]), ANY_NUMBER if token[0][0].isdigit() else ANY_UNIT]
        pos = token.end()
    return re.compile("".join([*parts, re.escape(line[pos:])]))


def matches(line: str, printed: list[str]) -> bool:
    """Whether the sample line is, numbers aside, one of the lines printed."""
    regex = pattern(line)
    return any(regex.fullmatch(p) for p in printed)


@pytest.fixture(scope="module")
def printed(emulator: azurite.Emulator, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Every stdout line of the real runs (module docstring)."""
    root = tmp_path_factory.mktemp("samples")
    rng = random.Random(41)
    blobs = {f"ckpt/shard-{i:02d}.safetensors": rng.randbytes(3 << 20) for i in range(4)}
    blobs |= {"ckpt/config.json": b"{}", "ckpt/tokenizer/tokenizer.json": b"t" * 5000}
    azurite.upload(emulator, "docsamples", blobs)
    env = emulator.key_env()
    lines: list[str] = []
    with FaultProxy(emulator, [Rule("503", blob="ckpt/shard-01*", nth=1, retry_after=0)]) as proxy:
        runs = [[proxy.url("docsamples", "ckpt"), str(root / "node{rank}"), "--verify"]]
        runs += [[emulator.url("docsamples", "ckpt"), str(root / "node{rank}")]]  # nothing left to copy
        runs += [[emulator.url("docsamples", "ckpt"), str(root / "dry{rank}"), "--dry-run"]]
        source = root / "src"
        for name, data in blobs.items():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes(data)
        runs += [[str(source / "ckpt"), str(root / "local{rank}")]]
        for args in runs:
            result = run_cli([*args, "--no-progress"], n=2, env=env)
            assert result.returncode == 0, result.output
            lines += result.stdout.splitlines()
    assert any("retries: 1 (503=1)" in line for line in lines)
    return lines


def test_the_docs_have_report_samples_of_every_line() -> None:
    tags = {line.split("]")[0] + "]" for _, line in samples() if line.startswith("[")}
    assert tags == {f"[{t}]" for t in TAGS}
    assert any(line.startswith("azcp-cluster: ") for _, line in samples())  # the summary line too


def test_every_sample_report_line_is_what_a_real_run_prints(printed: list[str]) -> None:
    drifted = [f"{page}: {line}" for page, line in samples() if not matches(line, printed)]
    assert drifted == []


def test_a_drifted_sample_does_not_match(printed: list[str]) -> None:
    """The matcher is strict where the words are: the old samples' lines fail, their fixed ones pass."""
    stale = "[bcast] 33 shards 67730965 bytes T=1.279s BW=0.42 Gb/s (64.59 MiB at 50.50 MiB/s)"
    assert not matches(stale, printed)
    assert matches(stale + " via chain (1 MiB pieces)", printed)
    assert not matches("[cluster] 1 node, 2 ranks, 2 writers, 2 downloading", printed)  # the old words
    assert matches("[cluster] 16 ranks on 1 host, 2 copies, 16 downloading", printed)
    assert not matches("[verify] 27 files T=0.120s: all copies match", printed)
