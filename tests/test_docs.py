"""The README documents every option the parser has, and every exit code."""

from __future__ import annotations

from pathlib import Path

from azcp_cluster.errors import EXIT_CODES
from azcp_cluster.options import build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def test_every_option_is_in_the_readme() -> None:
    options = [s for action in build_parser()._actions for s in action.option_strings if s.startswith("--")]
    assert len(options) > 15
    missing = [o for o in options if f"`{o}" not in README]
    assert missing == []


def test_every_exit_code_is_in_the_readme() -> None:
    for code in EXIT_CODES:
        assert f"| {code} |" in README
