"""The README documents every option the parser has, and every exit code; the docs' links resolve."""

from __future__ import annotations

import re
from pathlib import Path

from azcp_cluster.errors import EXIT_CODES
from azcp_cluster.options import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_option_is_in_the_readme() -> None:
    options = [s for action in build_parser()._actions for s in action.option_strings if s.startswith("--")]
    assert len(options) > 15
    missing = [o for o in options if f"`{o}" not in README]
    assert missing == []


def test_every_exit_code_is_in_the_readme() -> None:
    for code in EXIT_CODES:
        assert f"| {code} |" in README


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
