"""The listing shared out over 4 ranks (stages/survey.list_in_parallel), on the real emulator.

With pages of three blobs and probes of two, a small tree takes every path of a large one:
directories with more than a page continued by other ranks from their markers, levels
listed a step down by all ranks, the rest flat; the copies must be what was uploaded.
"""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

from azcp_cluster.devtools import azurite
from tests.conftest import assert_copies, run_cli

WRAPPER = textwrap.dedent(
    """
    import json, os, sys
    from azcp_cluster.azure import bloblist, blobrest
    from azcp_cluster import cli

    blobrest.PAGE, bloblist.PROBE = 3, 2
    real = bloblist.list_levels
    log = sys.argv.pop(1)

    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "x"))

    def logged(source, auth, cfg, folders):
        if folders:
            with open(os.path.join(log, rank), "a") as f:
                f.write(json.dumps(folders) + "\\n")
        return real(source, auth, cfg, folders)

    bloblist.list_levels = logged
    sys.exit(cli.main())
    """
)


def test_a_listing_shared_out_over_four_ranks_copies_every_blob(emulator: azurite.Emulator, tmp_path: Path) -> None:
    container = "share" + uuid.uuid4().hex[:12]
    files: dict[str, bytes] = {f"top-{i}.bin": b"t" * i for i in range(4)}
    for w in range(4):  # four directories of more than a page, directories on their first
        files.update({f"wide{w}/f{i:02d}": f"{w}-{i}".encode() for i in range(7)})
        files.update({f"wide{w}/a-sub{s}/g{i}": f"{w}{s}{i}".encode() for s in range(2) for i in range(4)})
    files.update({f"leaf/x{i:02d}": b"l" for i in range(8)})  # more than a page, no directory: flat
    files["deep/a/b/c/d/e/leaf.txt"] = b"deep"  # below the descent's last level: listed flat
    files["odd names/ä ö+%#&=.txt"] = b"odd"
    azurite.upload(emulator, container, files)
    script = tmp_path / "wrap.py"
    script.write_text(WRAPPER)
    log = tmp_path / "log"
    log.mkdir()
    result = run_cli([str(log), emulator.url(container), str(tmp_path / "d" / "{rank}"), "--no-progress"],
                     env=emulator.key_env(), program=[str(script)], json_path=tmp_path / "r.json")  # fmt: skip
    assert result.returncode == 0, result.output
    assert_copies(tmp_path / "d", files)
    assert result.json is not None and result.json["files"] == len(files)
    # Level listings ran on more than one rank, continued directories among them.
    shares = {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in log.iterdir()}
    assert len(shares) > 1, shares
    continued = [item for lines in shares.values() for items in lines for item in items if item[1]]
    assert {folder for folder, _ in continued} >= {f"wide{w}/" for w in range(4)}, shares
