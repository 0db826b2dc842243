"""The documentation's figures are what their sources draw: docs/figures/render.py, from the committed data.

Each figure is rendered into a temporary directory and compared byte for byte with the committed SVG, so a
figure not redrawn after its source or its data changed fails here (`python docs/figures/render.py` redraws
them all). The bytes depend on matplotlib's version (its layout and its bundled fonts), hence the pin in the
test extra, checked first.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
RESULTS = ROOT / "benchmarks" / "results"
COMMITTED = sorted(p.stem for p in FIGURES.glob("*.svg"))


def _render() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_figures_render", FIGURES / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def render() -> ModuleType:
    return _render()


def test_matplotlib_is_the_pinned_version() -> None:
    import matplotlib

    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pinned = re.search(r'"matplotlib==([0-9.]+)"', pyproject)
    assert pinned, "the test extra pins matplotlib's version"
    assert matplotlib.__version__ == pinned[1], (
        f"the figures are compared byte for byte as matplotlib {pinned[1]} draws them; "
        f"this is {matplotlib.__version__}: pip install -e '.[test]'"
    )


def test_every_figure_is_committed(render: ModuleType) -> None:
    assert sorted(render.FIGURES) == COMMITTED


@pytest.mark.parametrize("name", COMMITTED)
def test_figure_is_what_its_source_draws(name: str, render: ModuleType, tmp_path: Path) -> None:
    drawn = render.render(name, tmp_path).read_bytes()
    assert drawn == (FIGURES / f"{name}.svg").read_bytes(), (
        f"docs/figures/{name}.svg is stale: run python docs/figures/render.py and commit it"
    )


def test_a_changed_datum_makes_a_stale_figure(render: ModuleType, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The comparison sees one number of a benchmark's result change."""
    results = tmp_path / "results"
    results.mkdir()
    for name in ("bench-cluster-local.json", "bench-cluster-stream.json", "bench-listing.json", "bench-reruns.json"):
        shutil.copy(RESULTS / name, results / name)
    result = json.loads((results / "bench-cluster-local.json").read_text(encoding="utf-8"))
    result["rows"][0]["tool_s"] += 0.5
    (results / "bench-cluster-local.json").write_text(json.dumps(result), encoding="utf-8")
    monkeypatch.setattr(render, "RESULTS", results)
    out = tmp_path / "out"
    out.mkdir()
    assert render.render("bench-cluster", out).read_bytes() != (FIGURES / "bench-cluster.svg").read_bytes()
    assert render.render("bench-listing", out).read_bytes() == (FIGURES / "bench-listing.svg").read_bytes()


def test_every_figure_is_shown(render: ModuleType) -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *ROOT.glob("docs/*.md")])
    assert [n for n in render.FIGURES if f"figures/{n}.svg" not in text] == []


def test_small_files_figures_are_the_benchmarks_docs() -> None:
    """docs/figures/small-files.json transcribes docs/benchmarks.md: every number of it is there."""
    data = json.loads((FIGURES / "small-files.json").read_text(encoding="utf-8"))
    doc = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    numbers = [data["before_packing_s"]]
    for runs in [*data["runs_s"].values(), *data["sync_stage_s"].values()]:
        numbers.extend(runs)
        assert ", ".join(f"{v:.2f}" for v in runs) in doc
    assert all(f"{v:.2f}".rstrip("0") in doc for v in numbers)
