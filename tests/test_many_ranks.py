"""64 ranks on this machine (oversubscribed): the agreements and collectives hold at that rank count.

Tiny data, so what is tested is the control plane: every rank lists nothing but receives the
listing, plans the same plan, takes part in every agreement, and ends; ranks with nothing to
download wait without hanging; 64 nodes' copies (one DEST per rank) are byte-identical.

About 50 s on 2 cores (64 interpreters start there): marked slow, run by CI's own step
(.ci/run), not by the default suite.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from tests.conftest import run_cli, tree_of

RANKS = 64
pytestmark = pytest.mark.slow


def test_sixty_four_ranks_copy_a_small_tree_byte_identical(emulator: azurite.Emulator, tmp_path: Path) -> None:
    container = "many" + uuid.uuid4().hex[:12]
    # One file split over many ranks (64 KiB shards), and small ones: some ranks download,
    # most only receive, every one of them writes its own copy.
    files = {"big.bin": pseudo_random(3 * MiB, "many-big")}
    files.update({f"small/f{i:02d}.txt": pseudo_random(1000 + 37 * i, f"many{i}") for i in range(30)})
    azurite.upload(emulator, container, files)
    result = run_cli([emulator.url(container), str(tmp_path / "d" / "{rank}"), "--no-progress", "--shard-size",
                      "64KiB", "--block-size", "64KiB"], n=RANKS, env=emulator.key_env(),
                     json_path=tmp_path / "r.json", timeout=240)  # fmt: skip
    assert result.returncode == 0, result.output
    doc = result.json
    assert doc is not None and doc["ranks"] == RANKS and doc["writers"] == RANKS
    assert doc["downloaded_bytes"] == sum(map(len, files.values()))
    assert sum(1 for load in doc["plan_loads"] if load) >= 40, "the big file's shards were not spread"
    expected = {rel: hashlib.md5(data).hexdigest() for rel, data in files.items()}
    for rank in range(RANKS):
        copy = tree_of(tmp_path / "d" / str(rank))
        assert {rel: hashlib.md5(data).hexdigest() for rel, data in copy.items()} == expected, f"rank {rank}"
