"""The README links to the one options and exit-code table; the docs' links resolve; the help and usage.md."""

from __future__ import annotations

import re
from pathlib import Path

from azcp_cluster.options import build_parser
from azcp_cluster.run.report import Report
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_sends_options_and_exit_codes_to_usage_md() -> None:
    """The README is a front page: the options and the exit codes are docs/usage.md's one table each
    (tests/test_optiontable.py: generated, current, no copy anywhere else), and it links there."""
    assert "](docs/usage.md#exit-codes)" in README and "](docs/usage.md)" in README
    assert "| code |" not in README and "| `--" not in README


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to hyphens, -1 on repeats."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"(?ms)^```.*?^```", "", markdown), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, 0) + 1
        if seen[slug] > 1:
            seen[f"{slug}-{seen[slug] - 1}"] = 1
    return set(seen)


def test_every_relative_link_resolves() -> None:
    """Links and images of README.md and docs/*.md: the file is there, and so is the heading an anchor names."""
    broken = []
    for page in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]:
        text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            if not linked.exists() or (
                anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text(encoding="utf-8"))
            ):
                broken.append(f"{page.name}: {target}")
    assert broken == []


def _help(columns: str | None) -> str:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    proc = subprocess.run([sys.executable, "-m", "azcp_cluster", "--help"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_help_fits_80_columns_in_groups_with_examples() -> None:
    for columns in (None, "200", "60"):
        text = _help(columns)
        wide = [line for line in text.splitlines() if len(line) > 80]
        assert wide == [], wide
    for heading in ("what to copy:", "download:", "broadcast:", "checks and output:", "advanced:", "examples:"):
        assert f"\n{heading}\n" in text, heading
    examples = text.split("\nexamples:\n")[1].split("\n\n")[0]
    assert examples.count("azcp-cluster ") == 2 and "srun" in examples and "mpiexec" in examples
    assert "Units: bytes are binary" in text


def test_one_option_table_gives_the_parser_its_placeholders_and_the_api_its_fields() -> None:
    import dataclasses

    from azcp_cluster.api import OPTIONS as API_OPTIONS
    from azcp_cluster.core.config import Config
    from azcp_cluster.options import GROUPS, OPTIONS

    placeholders = {"SIZE", "N", "SECONDS", "RATE", "GLOB", "PATH", "MODE", "RANK", "METHOD", None}
    assert {o.metavar for o in OPTIONS} <= placeholders  # one word per kind of value, not BLOCK_SIZE beside K
    assert {o.group for o in OPTIONS} == set(GROUPS)
    fields = {f.name for f in dataclasses.fields(Config)} - {"source", "dest"}
    assert {o.field for o in OPTIONS} == fields == set(API_OPTIONS)  # every field set by the table, nothing else
    parsed = {s for action in build_parser()._actions for s in action.option_strings if s.startswith("--")}
    assert parsed - {"--help", "--version"} == {o.flag for o in OPTIONS if o.flag}


def test_an_options_error_writes_every_field_at_its_empty_value_as_usage_md_says(tmp_path: Path) -> None:
    """The JSON report of an error in the options: what the code writes, and what usage.md says of it
    (it said "with those two fields only", while every field is there)."""
    result = run_cli(["/src", str(tmp_path / "d"), "--concurrency", "0"], n=0, json_path=tmp_path / "r.json")
    assert result.returncode == 2, result.output
    (line,) = result.stderr.splitlines()
    assert result.json == {**Report().to_json(), "exit_code": 2, "error": line}
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    paragraph = " ".join(usage.split("### JSON report", 1)[1].split("| field |", 1)[0].split())
    assert "For an error in the options" in paragraph and "two fields only" not in paragraph
    assert "it has every field too, each at its empty value" in paragraph
    table = usage.split("### JSON report", 1)[1].split("## Exit codes", 1)[0]
    assert [key for key in result.json if f"`{key}`" not in table] == []  # each field is documented
