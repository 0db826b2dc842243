"""benchmarks/cluster.py's bounds: the links', and the box's one disk that all its hosts write to."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from azcp_cluster.core.config import MiB
from azcp_cluster.devtools.box import Link
from benchmarks.cluster import CASES, COLUMNS, RAW, bounds, check_copies, disk_rate, table, verdict

S = 128 * MiB
FRONT, FABRIC = Link(mbit=100), Link(mbit=400)


@pytest.mark.parametrize("case", CASES)
def test_the_bound_is_the_largest_part_and_the_disk_binds_only_what_writes(case: str) -> None:
    without = bounds(case, S, 8, FRONT, FABRIC)
    assert "disk_s" not in without
    slow = bounds(case, S, 8, FRONT, FABRIC, disk=10 * MiB)  # 8 x 128 MiB at 10 MiB/s: 102 s
    fast = bounds(case, S, 8, FRONT, FABRIC, disk=100_000 * MiB)
    if case in RAW:  # no disk written: as without
        assert slow == without == fast
        return
    assert slow["disk_s"] == pytest.approx(8 * S / (10 * MiB))
    assert slow["bound_s"] == slow["disk_s"] > without["bound_s"]
    assert fast["bound_s"] == without["bound_s"]  # a fast disk binds nothing
    for figures in (without, slow, fast):
        parts = [v for k, v in figures.items() if k not in ("bound_s", "sum_s")]
        assert figures["bound_s"] == max(parts)


def test_the_streamed_bound_is_the_download_or_the_ring() -> None:
    figures = bounds("stream", S, 8, FRONT, FABRIC)
    assert figures["download_s"] == pytest.approx(S / 8 / (100e6 / 8))
    assert figures["fanout_s"] == pytest.approx(S * 7 / 8 / (400e6 / 8))
    assert figures["bound_s"] == figures["fanout_s"] and figures["sum_s"] > figures["bound_s"]


class _Host:
    def __init__(self, name: str) -> None:
        self.name = name


class _Box:
    """What disk_rate uses of a box: its hosts and where each one's DEST is."""

    def __init__(self, root: Path, hosts: int) -> None:
        self.root = root
        self.hosts = [_Host(f"h{i}") for i in range(hosts)]

    def dest_of(self, host: _Host) -> Path:
        return self.root / "dest" / host.name


def test_the_disk_rate_is_measured_where_the_hosts_write_and_leaves_nothing(tmp_path: Path) -> None:
    bx = _Box(tmp_path, 3)
    rate = disk_rate(bx, 4 * MiB + 100)  # type: ignore[arg-type]  # (not a whole 4 KiB: rounded up)
    assert 1 * MiB < rate < 1e13
    assert os.listdir(tmp_path / "dest") == []


def test_a_writer_that_fails_fails_the_measure_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.posix_fallocate

    def refuse(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".disk-h1"):
            raise OSError(28, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    with pytest.raises(RuntimeError, match="No space left"):
        disk_rate(_Box(tmp_path, 3), 4 * MiB)  # type: ignore[arg-type]
    assert os.listdir(tmp_path / "dest") == []


def test_a_name_already_taken_is_not_written_through_nor_removed(tmp_path: Path) -> None:
    bx = _Box(tmp_path, 2)
    (tmp_path / "dest").mkdir()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not the benchmark's")
    (tmp_path / "dest" / ".disk-h1").symlink_to(target)
    with pytest.raises(RuntimeError, match="FileExists"):
        disk_rate(bx, 4 * MiB)  # type: ignore[arg-type]
    assert target.read_bytes() == b"not the benchmark's"
    assert os.listdir(tmp_path / "dest") == [".disk-h1"]  # its own file removed, the link left


def test_a_copy_missing_or_differing_on_any_host_fails_the_run(tmp_path: Path) -> None:
    files = {"a.bin": b"x" * 1000, "b.bin": b"y" * 10}
    bx = _Box(tmp_path, 3)
    for host in bx.hosts:
        (bx.dest_of(host)).mkdir(parents=True)
        for name, data in files.items():
            (bx.dest_of(host) / name).write_bytes(data)
    check_copies(bx, files)  # type: ignore[arg-type]
    (bx.dest_of(bx.hosts[2]) / "a.bin").write_bytes(b"x" * 999 + b"z")
    with pytest.raises(RuntimeError, match=r"h2: a\.bin"):
        check_copies(bx, files)  # type: ignore[arg-type]
    (bx.dest_of(bx.hosts[2]) / "a.bin").write_bytes(files["a.bin"])
    (bx.dest_of(bx.hosts[1]) / "b.bin").unlink()
    with pytest.raises(RuntimeError, match=r"h1: b\.bin"):
        check_copies(bx, files)  # type: ignore[arg-type]


def test_with_rails_the_tools_cases_and_the_chain_per_rail_are_bound_with_every_rail() -> None:
    rails = 2
    assert bounds("local", S, 4, FRONT, FABRIC, rails=rails)["bound_s"] == pytest.approx(S / (rails * 400e6 / 8))
    assert bounds("rail-chain", S, 4, FRONT, FABRIC, rails=rails)["bound_s"] == pytest.approx(S / (rails * 400e6 / 8))
    stream = bounds("stream", S, 4, FRONT, FABRIC, rails=rails)
    assert stream["fanout_s"] == pytest.approx(S * 3 / 4 / (rails * 400e6 / 8))
    assert stream["download_s"] == pytest.approx(S / 4 / (100e6 / 8))  # the frontend is one NIC still
    for one_rank_per_host in ("chain", "ibcast", "ring", "every-node"):  # on rail 0 alone, or no fabric
        assert bounds(one_rank_per_host, S, 4, FRONT, FABRIC, rails=rails) == bounds(
            one_rank_per_host, S, 4, FRONT, FABRIC
        )


def _row(hosts: int, case: str, seconds: float, egress: float) -> dict[str, object]:
    """A row as benchmarks.cluster.row makes it, with the fields the table and the verdict read."""
    return {"hosts": hosts, "case": case, "bytes": S, "tool_s": seconds, "bound_s": 1.0, "ratio": seconds,
            "egress_ratio": egress, "cpu_busy": 0.5, "cpu_steal": 0.0, "rail_bytes": [1], "fanout": None}  # fmt: skip


def test_the_table_has_a_header_and_the_last_line_is_the_tool_against_every_node() -> None:
    rows = [_row(2, "stream", 2.0, 1.0), _row(2, "every-node", 5.0, 2.0),
            _row(4, "stream", 3.2, 1.0), _row(4, "chain", 1.0, 0.0), _row(4, "every-node", 11.8, 4.0)]  # fmt: skip
    lines = table(rows)
    assert lines[0].split() == " ".join(COLUMNS).split() and len(lines) == 1 + len(rows)
    assert lines[1].split()[:5] == ["2", "stream", "2.00", "1.00", "2.00"]
    assert verdict(rows) == (
        "on 4 hosts, S = 128 MiB: the tool (stream) 3.2 s against every node downloading 11.8 s (3.7 x); "
        "egress 1.00 x S against 4.00 x S"
    )
    assert verdict(rows[3:4]).startswith("no host count has both")
