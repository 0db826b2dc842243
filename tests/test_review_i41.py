"""What a hostile review of the mirror, the dry run's list and the summary line found (each case
failed before its fix): a run that removed files said "nothing to do"; ``--dry-run -q`` printed
nothing, pending removals included; a file name holding a line break forged a line of the dry
run's list, and an undecodable one made ``deleted_paths`` a string strict JSON parsers refuse.
Real runs of the CLI on a local SOURCE, one rank (no launcher) or two under ``mpiexec``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import run_cli


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    (src / "keep.txt").write_text("kept\n")
    assert run_cli([str(src), str(dest), "-q"], n=0).returncode == 0
    return src, dest


def test_a_run_that_removed_files_never_says_nothing_to_do(tmp_path: Path) -> None:
    src, dest = _tree(tmp_path)
    (dest / "stale.txt").write_text("stale\n")
    result = run_cli([str(src), str(dest), "--delete", "-q"], n=0)
    assert result.returncode == 0, result.output
    assert result.stdout.splitlines() == [
        "azcp-cluster: nothing to copy: 1 file already present in 1 copy; 1 file not in SOURCE removed from 1 copy"
    ], result.output
    assert not (dest / "stale.txt").exists()


def test_a_dry_run_under_quiet_still_lists_what_it_would_do(tmp_path: Path) -> None:
    src, dest = _tree(tmp_path)
    (dest / "stale.txt").write_text("stale\n")
    (src / "new.txt").write_text("new\n")
    result = run_cli([str(src), str(dest), "--delete", "--dry-run", "-q"], n=0)
    assert result.returncode == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["skip", "new", "delete", "[dry-run]"], result.output
    assert lines[2].endswith("stale.txt") and (dest / "stale.txt").exists()


def test_a_file_name_cannot_forge_a_line_of_the_dry_run_nor_break_the_json(tmp_path: Path) -> None:
    src, dest = _tree(tmp_path)
    for node in ("0", "1"):
        (dest / node).mkdir(parents=True)
        (dest / node / "keep.txt").write_text("kept\n")
    forged = "evil\n[dry-run] 0 files"
    (dest / "0" / forged).write_text("x")
    undecodable = os.fsencode(dest / "1") + b"/bad\xff"
    with open(undecodable, "wb") as fh:
        fh.write(b"y")
    args = [str(src), str(dest / "{rank}"), "--delete"]
    dry = run_cli([*args, "--dry-run"], n=2)
    assert dry.returncode == 0, dry.output
    lines = dry.stdout.splitlines()
    assert [line for line in lines if line.startswith("[dry-run]")] == [lines[-2]], dry.stdout  # then [total]
    assert "evil\\n[dry-run] 0 files" in dry.stdout and "bad\\udcff" in dry.stdout, dry.stdout
    report = tmp_path / "report.json"
    real = run_cli([*args, "--json", str(report)], n=2)
    assert real.returncode == 0, real.output
    raw = report.read_bytes()
    raw.decode("utf-8", errors="strict")  # no lone surrogate written as a byte sequence
    doc = json.loads(raw)
    assert sorted(doc["deleted_paths"]) == ["bad\\udcff", "evil\\n[dry-run] 0 files"], doc["deleted_paths"]
    assert not (dest / "0" / forged).exists() and not os.path.exists(undecodable)


def test_a_file_removed_from_two_copies_is_one_file_as_the_dry_run_counts_it(tmp_path: Path) -> None:
    """A new user's find: one file gone from SOURCE, removed from both copies, was '2 files' in
    the run's lines where the dry run had said '1 delete ... on 2 copies'."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep.txt").write_text("kept\n")
    (src / "gone.txt").write_text("going\n")
    template = str(tmp_path / "dest" / "{rank}")
    assert run_cli([str(src), template, "-q"], n=2).returncode == 0
    (src / "gone.txt").unlink()
    dry = run_cli([str(src), template, "--delete", "--dry-run"], n=2)
    assert "[dry-run] 1 file: 1 skip (5 B); 1 delete (6 B) on 2 copies" in dry.stdout, dry.output
    real = run_cli([str(src), template, "--delete"], n=2)
    assert real.returncode == 0, real.output
    assert "[delete] 1 file not in SOURCE removed from 2 copies, 12 bytes in all (12 B)" in real.stdout, real.stdout
    assert real.stdout.splitlines()[-1].endswith("; 1 file not in SOURCE removed from 2 copies"), real.stdout


def test_an_abbreviated_option_is_refused_not_taken_for_delete(tmp_path: Path) -> None:
    src, dest = _tree(tmp_path)
    (dest / "stale.txt").write_text("stale\n")
    result = run_cli([str(src), str(dest), "--del"], n=0)
    assert result.returncode == 2, result.output
    assert "--delete" in result.stderr and (dest / "stale.txt").exists()
