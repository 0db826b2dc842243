"""Where the time goes: the JSON report's timeline, each stage's start and end on each rank.

Real `mpiexec -n 4`, a local SOURCE and the emulator (streaming and two-phase): every stage
the run agreed on appears once, in the order run, with each rank's start and end of its own
work (seconds since that rank's run started), inside the run's total; the download inside a
streaming transfer appears for the ranks that downloaded, between the transfer's start and end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import run_cli

RANKS = 4
FILES = {"big.bin": pseudo_random(6 * MiB + 5, "t-big"), "small.txt": b"hello", "empty": b""}
OPTIONS = ["--bcast-chunk", "1MiB", "--no-progress"]
BLOB_OPTIONS = ["--block-size", "1MiB", *OPTIONS]  # --block-size: a blob URL's only


def check_spans(doc: dict[str, Any], expected: list[str]) -> dict[str, dict[str, Any]]:
    """Every rank's spans run forward, inside the run; the stages are ``expected``, in order."""
    timeline = doc["timeline"]
    assert [entry["stage"] for entry in timeline] == expected
    total = doc["stages"]["total"]["seconds"]
    for rank in range(RANKS):
        spans = [(e["start"][rank], e["end"][rank]) for e in timeline if e["start"][rank] is not None]
        assert all(0 <= start <= end <= total for start, end in spans), (rank, spans, total)
        starts = [start for start, _ in spans if start is not None]
        assert starts == sorted(starts), (rank, spans)
    origins = doc["timeline_origin"]
    assert len(origins) == RANKS and all(abs(o - time.time()) < 300 for o in origins)
    return {entry["stage"]: entry for entry in timeline}


def test_a_local_copy_has_each_stage_on_each_rank(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name, data in FILES.items():
        (source / name).write_bytes(data)
    result = run_cli([str(source), str(tmp_path / "d" / "{rank}"), *OPTIONS], json_path=tmp_path / "r.json")
    assert result.returncode == 0, result.output
    assert result.json is not None
    stages = check_spans(
        result.json, ["setup", "roles", "lock", "list", "diff", "allocate", "bcast", "sync", "rename", "record"]
    )
    assert all(s is not None for entry in stages.values() for s in entry["start"])


@pytest.mark.parametrize("overlap", [True, False], ids=["streaming", "two-phase"])
def test_a_blob_copy_shows_the_download(emulator: azurite.Emulator, tmp_path: Path, overlap: bool) -> None:
    container = f"timeline{int(overlap)}"
    azurite.upload(emulator, container, {f"d/{name}": data for name, data in FILES.items()})
    mode = [] if overlap else ["--no-overlap"]
    result = run_cli(
        [emulator.url(container, "d"), str(tmp_path / "d" / "{rank}"), *BLOB_OPTIONS, *mode],
        env=emulator.key_env(),
        json_path=tmp_path / "r.json",
    )
    assert result.returncode == 0, result.output
    assert result.json is not None
    if overlap:
        stages = check_spans(
            result.json,
            ["setup", "roles", "lock", "list", "diff", "allocate", "download", "transfer", "sync", "rename", "record"],
        )
        download, transfer = stages["download"], stages["transfer"]
        ranks = [r for r in range(RANKS) if download["start"][r] is not None]
        assert ranks, "no rank's download in the timeline"
        for r in ranks:
            assert transfer["start"][r] == download["start"][r] <= download["end"][r] <= transfer["end"][r]
    else:
        check_spans(
            result.json,
            ["setup", "roles", "lock", "list", "diff", "allocate", "download", "bcast", "sync", "rename", "record"],
        )
