"""docs/usage.md's options and exit-code tables: generated from the code, current, and the only ones.

The tables lie between marker comments and are written by ``python -m azcp_cluster.devtools.optiontable``
from ``options.OPTIONS`` and ``errors.EXIT_CODES``; here the file is compared with what the generator
writes now, with ``azcp-cluster --help`` (a real run of the command), and with the other pages.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from azcp_cluster.core.errors import EXIT_CODES
from azcp_cluster.devtools import optiontable

ROOT = Path(__file__).resolve().parents[1]
USAGE = ROOT / "docs" / "usage.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A table row whose first cell is an option alone, as an options table writes it: | `--lock MODE` |
OPTION_ROW = re.compile(r"^\| `--[a-z][a-z-]*(?: \[?[A-Z]+\]?)?` \|", re.M)


def _section(text: str, name: str) -> str:
    """What lies between the generated table's markers."""
    return text.split(optiontable.begin(name) + "\n", 1)[1].split(optiontable.end(name), 1)[0]


def _help_flags() -> set[str]:
    """The long options ``azcp-cluster --help`` lists, each where its help line starts."""
    proc = subprocess.run([sys.executable, "-m", "azcp_cluster", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"(?m)^ {2}(?:-\w, )?(--[a-z][a-z-]*)", proc.stdout))


def test_the_tables_in_usage_md_are_what_the_generator_writes() -> None:
    text = USAGE.read_text(encoding="utf-8")
    assert optiontable.rewrite(text) == text, "docs/usage.md is stale: python -m azcp_cluster.devtools.optiontable"
    assert optiontable.main(["--check"]) == 0


def test_a_changed_option_makes_the_table_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above sees an option's help change, and the rewrite puts the new text in."""
    text = USAGE.read_text(encoding="utf-8")
    changed = dataclasses.replace(optiontable.OPTIONS[0], help="a new meaning")
    monkeypatch.setattr(optiontable, "OPTIONS", (changed, *optiontable.OPTIONS[1:]))
    new = optiontable.rewrite(text)
    assert new != text and f"| {optiontable._usage(changed)} | any | a new meaning |" in _section(new, "options")
    assert new.replace(_section(new, "options"), "") == text.replace(_section(text, "options"), "")


def test_the_options_table_lists_what_help_lists() -> None:
    table = _section(USAGE.read_text(encoding="utf-8"), "options")
    first_cells = re.findall(r"(?m)^\| (`-[^|]*) \|", table)  # `-q`, `--quiet` has its long flag second
    rows = {flag for cell in first_cells for flag in re.findall(r"`(--[a-z][a-z-]*)[ `]", cell)}
    help_flags = _help_flags()
    assert len(help_flags) > 20
    assert rows == help_flags


def test_the_exit_code_table_is_the_codes_table() -> None:
    table = _section(USAGE.read_text(encoding="utf-8"), "exit codes")
    rows = dict(re.findall(r"(?m)^\| (\d+) \| (.+) \|$", table))
    assert {int(c) for c in rows} == set(EXIT_CODES)
    assert rows["3"] == EXIT_CODES[3] and rows["5"] == EXIT_CODES[5]


def test_the_options_table_and_the_exit_codes_exist_once() -> None:
    """No page keeps a copy of its own to drift: one options table and one exit-code table, in usage.md."""
    copies = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        if page == USAGE:
            for name in optiontable.TABLES:
                text = text.replace(_section(text, name), "")
        copies += [f"{page.name}: {m.group(0)}" for m in OPTION_ROW.finditer(text)]
        copies += [f"{page.name}: exit code table" for _ in re.finditer(r"(?m)^\| code \| meaning \|", text)]
    assert copies == []
