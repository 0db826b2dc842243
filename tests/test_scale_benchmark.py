"""The scale benchmark's mixes (benchmarks/scale.py): what each one is, and a small run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import scale

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def sizes_of(mix: str, files: int = 20_000) -> np.ndarray:
    return np.array([f.size for f in scale.synthetic(files, mix).files], dtype=np.int64)


def test_the_mixes_are_what_they_say() -> None:
    assert {"standard", "tester", "small", "medium", "bimodal", "pareto", "large", "tib", "tib-alone"} <= set(
        scale.MIXES
    )
    tester = sizes_of("tester")
    assert 0.008 < np.mean(tester >= GiB) < 0.012 and tester.max() <= 8 * GiB
    assert 0.45 < np.mean(tester < 64 * KiB) < 0.52 and 0.45 < np.mean((tester >= MiB) & (tester <= 64 * MiB)) < 0.52
    assert sizes_of("small").max() < 64 * KiB
    medium = sizes_of("medium")
    assert medium.min() >= MiB and medium.max() <= 64 * MiB
    bimodal = sizes_of("bimodal")
    assert np.all((bimodal <= 16 * KiB) | (bimodal >= 100 * MiB)) and 0.08 < np.mean(bimodal >= 100 * MiB) < 0.12
    pareto = sizes_of("pareto")
    assert np.median(pareto) < 16 * KiB and pareto.max() > 16 * MiB  # most small, a few far out
    large = sizes_of("large")
    assert large.min() >= 64 * MiB and large.max() <= 512 * MiB
    tib = sizes_of("tib")
    assert np.sum(tib == TiB) == 1 and np.sort(tib)[-2] < 64 * KiB
    assert list(sizes_of("tib-alone")) == [TiB]
    # Fixed by a seed: the same listing every time.
    assert np.array_equal(sizes_of("pareto"), pareto)


@pytest.mark.parametrize("mix", ["tester", "tib-alone"])
def test_a_small_run_reports_every_figure(mix: str, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    assert scale.main(["--mix", mix, "--files", "3000", "--ranks", "64", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())[mix]
    run = figures["as_run"]
    for key in ("decode_s", "plan_s", "schedule_s", "decode_plan_schedule_s", "decode_plan_schedule_cpu_s"):
        assert 0 <= run[key] < 60
    assert run["transfers"] > 0 and run["shards"] > 0 and 0 < run["peak_rss_mib"] < 1024
    assert figures["files"] == (1 if mix == "tib-alone" else 3000)
