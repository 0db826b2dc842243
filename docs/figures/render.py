"""The documentation's figures, drawn from sources in the repository.

    python docs/figures/render.py          # write every figure into docs/figures/
    python docs/figures/render.py --check  # exit 1 if a committed figure is not what its source draws

Each figure is a function of this module that draws one `Figure`; the benchmark plots read their
numbers from the committed results (benchmarks/results/bench-*.json, and docs/figures/small-files.json,
which holds figures of docs/benchmarks.md that have no JSON of their own). The SVGs are written
byte for byte the same on every run of one matplotlib version (fixed hash salt and ids, no date,
text as paths), so tests/test_figures.py can render each into a temporary directory and compare:
a figure that was not redrawn after its source or its data changed fails the suite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.style
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parents[1] / "benchmarks" / "results"  # the benchmarks' committed output

# What makes the SVG the same bytes on every run (same matplotlib, same bundled fonts).
STABLE = {
    "svg.hashsalt": "azcp-cluster",
    "svg.id": "azcp-figure",
    "svg.fonttype": "path",
    "font.family": "DejaVu Sans",
    "font.size": 9.0,
    "axes.titlesize": 8.5,
}
METADATA = {"Date": None, "Creator": None}

AZURE = "#d8e8f8"
RANK = "#fff2cc"
WRITER = "#e2f0d9"
DISK = "#eeeeee"
FABRIC = "#c0504d"
INK = "#222222"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    return data


def _box(ax: Any, x: float, y: float, w: float, h: float, text: str, color: str, size: float = 8.5) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.2,rounding_size=0.8",
                                facecolor=color, edgecolor=INK, linewidth=0.8))  # fmt: skip
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=INK)


def _arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], color: str = INK,
           both: bool = False, width: float = 0.9) -> None:  # fmt: skip
    style = "<|-|>" if both else "-|>"
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=9, color=color,
                                 linewidth=width, shrinkA=0, shrinkB=0))  # fmt: skip


def _notes(ax: Any, x: float, rows: list[tuple[float, str, str]]) -> None:
    """A heading and its lines beside each row of the diagram."""
    for y, heading, body in rows:
        ax.text(x, y + 1.6, heading, ha="left", va="bottom", fontsize=9, fontweight="bold", color=INK)
        ax.text(x, y + 1.2, body, ha="left", va="top", fontsize=8.2, color=INK, linespacing=1.35)


def _canvas(width: float, height: float, xmax: float, ymax: float) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, ymax)
    ax.set_axis_off()
    return fig, ax


# Node columns of the data-flow figures: their centres.
NODES = (8.0, 26.0, 44.0)


def _nodes(ax: Any, dots: float) -> None:
    for i, cx in enumerate(NODES):
        name = "node N" if i == len(NODES) - 1 else f"node {i + 1}"
        ax.add_patch(FancyBboxPatch((cx - 7.5, 2.0), 15, 41.5, boxstyle="round,pad=0,rounding_size=1.2",
                                    facecolor="white", edgecolor="#999999", linewidth=0.8, linestyle="--"))  # fmt: skip
        ax.text(cx, 41.6, name, ha="center", va="center", fontsize=8, color="#555555", style="italic")
    ax.text((NODES[1] + NODES[2]) / 2, dots, "…", ha="center", va="center", fontsize=11, color="#555555")


def _fan_out(ax: Any, y: float, both: bool) -> None:
    """The fan-out between the node writers: red, over MPI."""
    for left, right in itertools.pairwise(NODES):
        _arrow(ax, (left + 6.2, y), (right - 6.2, y), color=FABRIC, both=both, width=1.6)
        ax.text((left + right) / 2, y - 5.6, "MPI", ha="center", fontsize=8, color=FABRIC)


def dataflow() -> Figure:
    """A blob SOURCE: Azure → downloaders → their node's temporary files ⇄ node writer ⇄ fan-out."""
    source, ranks, disk, writer = 52.0, 37.5, 23.5, 9.0
    fig, ax = _canvas(9.0, 4.6, 104, 58)
    _box(ax, 1, source - 3, 50, 6.5, "Azure Blob Storage: one container or prefix", AZURE, 9)
    _nodes(ax, ranks + 2.5)
    for n, cx in enumerate(NODES):
        names = ("rank", "rank") if n == len(NODES) - 1 else (f"rank {2 * n}", f"rank {2 * n + 1}")
        for name, dx in zip(names, (-3.3, 3.3), strict=True):
            _box(ax, cx + dx - 2.9, ranks - 2.5, 5.8, 5, name, RANK, 6.5)
            _arrow(ax, (cx + dx, source - 3.2), (cx + dx, ranks + 2.7))
            _arrow(ax, (cx + dx, ranks - 2.7), (cx + dx, disk + 3.7))
        _box(ax, cx - 6, disk - 3.5, 12, 7, "NVMe: DEST's\ntemporary files", DISK, 7.5)
        _box(ax, cx - 6, writer - 3.5, 12, 7, "node writer", WRITER)
        _arrow(ax, (cx, writer + 3.7), (cx, disk - 3.7), both=True)
    _fan_out(ax, writer, both=True)
    _notes(ax, 55, [
        (source, "Azure Blob: every byte read once", "rank 0 lists; the downloaders list the rest"),
        (ranks, "Downloaders: every rank, its own share",
         "ranged GETs pinned to the ETag (LPT plan, the same on\nevery rank), received straight into buffers "
         "written\nwith O_DIRECT into the node's temporary files"),
        (disk, "NVMe on every node: the whole dataset",
         "temporary files at full size from the start; made\ndurable (fsync or one syncfs), then renamed"),
        (writer, "Node writer (one leader rank per node)",
         "reads each block back as it lands and sends it to every\nother node's writer over MPI (red), "
         "pipelined, while\nthe download goes on; writes what the others send"),
    ])  # fmt: skip
    return fig


def dataflow_local() -> Figure:
    """A local or shared SOURCE: one reader, the same fan-out."""
    source, writer, disk = 52.0, 30.0, 11.0
    fig, ax = _canvas(9.0, 4.6, 104, 58)
    _box(ax, 1, source - 3, 14, 6.5, "shared path", AZURE, 8.5)
    _nodes(ax, writer + 5.5)
    _arrow(ax, (NODES[0], source - 3.2), (NODES[0], writer + 3.7))
    for n, cx in enumerate(NODES):
        _box(ax, cx - 6, writer - 3.5, 12, 7, "reader and\nnode writer" if n == 0 else "node writer", WRITER, 8)
        _box(ax, cx - 6, disk - 3.5, 12, 7, "NVMe: DEST's\ntemporary files", DISK, 7.5)
        _arrow(ax, (cx, writer - 3.7), (cx, disk + 3.7))
    _fan_out(ax, writer, both=False)
    _notes(ax, 55, [
        (source, "A local or shared path (NFS, Lustre, blobfuse)", "read once, by one rank"),
        (writer, "One reader, the leader of its node; a writer per node",
         "the reader (--source-rank, or the lowest rank that sees\nthe path) lists it and reads every byte "
         "straight into\nthe fan-out (no download stage): over MPI (red),\npipelined, to every other node's writer"),
        (disk, "NVMe on every node: the whole dataset", "temporary files, made durable, then renamed"),
    ])  # fmt: skip
    return fig


# The cluster benchmark's cases (benchmarks/cluster.py) drawn here: each copy of the tool beside the raw
# MPI pattern it uses, run in the same batch over the same links, and the physical bound of both.
CASES = {
    "local": ("the tool, local SOURCE (one reader)", "o", "C0"),
    "chain": ("raw point-to-point chain (no disk)", "v", "C5"),
    "stream": ("the tool, blob SOURCE, streamed", "s", "C1"),
    "ring": ("raw ring of the same bytes (no download, no disk)", "<", "C4"),
}
PANELS = (("bench-cluster-local.json", "local", "chain", "bound S/B"),
          ("bench-cluster-stream.json", "stream", "ring", "bound max(S/(N·fe), S(N−1)/(N·B))"))  # fmt: skip


def _case(ax: Any, rows: list[dict[str, Any]], case: str) -> list[dict[str, Any]]:
    """One case's medians against hosts; its rows, by hosts."""
    label, marker, color = CASES[case]
    mine = sorted((r for r in rows if r["case"] == case), key=lambda r: r["hosts"])
    ax.plot([r["hosts"] for r in mine], [r["tool_s"] for r in mine], marker=marker, color=color, label=label)
    return mine


def cluster() -> Figure:
    """benchmarks/results/bench-cluster-{local,stream}.json: time against hosts beside the raw pattern and the
    physical bound; the emulator's egress over S."""
    fig = Figure(figsize=(10.0, 3.8))
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 0.8]})
    for ax, (name, tool, raw, bound) in zip(axes, PANELS, strict=False):
        rows = _load(name)["rows"]
        mine = _case(ax, rows, tool)
        _case(ax, rows, raw)
        hosts = [r["hosts"] for r in mine]
        ax.plot(hosts, [r["bound_s"] for r in mine], linestyle="--", color=INK, linewidth=1, label=bound)
        first = mine[0]
        ax.set(xlabel="hosts (one rank each)", ylabel="seconds (total − list)", xticks=hosts, ylim=(0, None),
               title=f"{first['bytes'] / 2**20:.0f} MiB, fe {first['front_mbit']:g} Mbit/s, "
               f"B {first['fabric_mbit']:g} Mbit/s, {first['mpi']}")  # fmt: skip
        ax.legend(fontsize=6.5, loc="lower right")
    stream = sorted((r for r in _load("bench-cluster-stream.json")["rows"] if r["case"] == "stream"),
                    key=lambda r: r["hosts"])  # fmt: skip
    hosts = [r["hosts"] for r in stream]
    axes[2].plot(hosts, [r["egress_ratio"] for r in stream], marker="s", color="C1", label="the tool, streamed")
    axes[2].plot(hosts, hosts, linestyle="--", color="C3", linewidth=1, label="every host downloading: N")
    axes[2].set(xlabel="hosts", ylabel="bytes the emulator sent / S", xticks=hosts, ylim=(0, None),
                title="egress from \"Azure\"")  # fmt: skip
    axes[2].legend(fontsize=6.5, loc="upper left")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _runs(ax: Any, labels: list[str], runs: list[list[float]], colors: list[str]) -> None:
    """A bar at each median, every run as a dot on it."""
    for i, (values, color) in enumerate(zip(runs, colors, strict=True)):
        ax.bar(i, statistics.median(values), color=color, alpha=0.55, edgecolor=INK, linewidth=0.6, width=0.6)
        ax.plot([i] * len(values), values, "o", color=INK, markersize=3)
    ax.set_xticks(range(len(labels)), labels)
    ax.grid(axis="y", alpha=0.3)


def listing() -> Figure:
    """benchmarks/results/bench-listing.json, bench-reruns.json: the 100,000-blob listing; no-op reruns."""
    doc = _load("bench-listing.json")["listing"]
    reruns = _load("bench-reruns.json")
    fig = Figure(figsize=(9.0, 3.6))
    first, blobs, local = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.1, 1, 1]})
    _runs(first, ["SDK,\nsequential", "lean,\none process", "the tool,\n4 ranks"],
          [doc["sdk_s"], doc["lean_s"], doc["four_ranks_list_s"]], ["#bbbbbb", "C0", "C2"])  # fmt: skip
    target = 0.4 * statistics.median(doc["sdk_s"])
    first.axhline(target, color=FABRIC, linestyle="--", linewidth=1)
    first.set(ylabel="seconds", title=f"listing {doc['files']:,} blobs\n(dashed: the target, 0.4 × SDK)")
    for ax, key, title in ((blobs, "noop_rerun", "no-op rerun, {blobs:,} blobs, {ranks} ranks"),
                           (local, "local_noop_rerun", "no-op rerun, {files:,} files, {ranks} ranks")):  # fmt: skip
        part = reruns[key]
        shapes = list(part["shapes"])
        names = [s.replace(" directories", " dirs").replace(" levels deep", " levels") for s in shapes]
        _runs(ax, names, [part["shapes"][s]["total_s"] for s in shapes], ["C0"] * len(shapes))
        ax.tick_params(axis="x", labelrotation=35, labelsize=7)
        ax.axhline(part["bound_s"], color=FABRIC, linestyle="--", linewidth=1)
        ax.set(ylabel="[total], seconds", ylim=(0, part["bound_s"] * 1.3),
               title=title.format(**part) + f"\n(dashed: the bound, {part['bound_s']:g} s)")  # fmt: skip
    fig.tight_layout()
    return fig


def small_files() -> Figure:
    """docs/figures/small-files.json: 20,000 small files to 2 nodes, the tool against tar; the sync stage."""
    doc = json.loads((HERE / "small-files.json").read_text(encoding="utf-8"))
    fig = Figure(figsize=(9.0, 3.4))
    copy, sync = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    _runs(copy, ["the tool,\n[total]", "the tool,\nwhole mpiexec", "two tar copies\n+ sync"],
          list(doc["runs_s"].values()), ["C2", "C2", "#bbbbbb"])  # fmt: skip
    copy.axhline(doc["before_packing_s"], color="#777777", linestyle=":", linewidth=1)
    before = f"the tool before small files shared a transfer: {doc['before_packing_s']:g} s"
    copy.text(-0.4, doc["before_packing_s"], before,
              color="#555555", fontsize=7, va="bottom")  # fmt: skip
    copy.set(ylabel="seconds", ylim=(0, 15),
             title=f"{doc['files']:,} files of 0 to 16 KiB, local SOURCE → {doc['ranks']} nodes")  # fmt: skip
    stages = list(doc["sync_stage_s"])
    _runs(sync, ["an fsync\nper file", "one syncfs"], [doc["sync_stage_s"][s] for s in stages], ["#bbbbbb", "C2"])
    sync.set(ylabel="seconds", title="the sync stage (2 ranks, one machine)")
    fig.tight_layout()
    return fig


FIGURES: dict[str, Callable[[], Figure]] = {
    "dataflow": dataflow,
    "dataflow-local": dataflow_local,
    "bench-cluster": cluster,
    "bench-listing": listing,
    "bench-small-files": small_files,
}


def render(name: str, directory: Path) -> Path:
    """Draw one figure into DIRECTORY/NAME.svg, the same bytes each time."""
    path = directory / f"{name}.svg"
    with matplotlib.style.context("default"), matplotlib.rc_context(STABLE):
        FIGURES[name]().savefig(path, format="svg", metadata=METADATA)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed figures; write nothing")
    parser.add_argument("--png", metavar="DIR", help="also write PNGs here, to look at")
    args = parser.parse_args(argv)
    stale = []
    for name in FIGURES:
        if args.check:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                if render(name, Path(tmp)).read_bytes() != (HERE / f"{name}.svg").read_bytes():
                    stale.append(name)
            continue
        print(render(name, HERE))
        if args.png:
            with matplotlib.style.context("default"), matplotlib.rc_context(STABLE):
                FIGURES[name]().savefig(Path(args.png) / f"{name}.png", dpi=100)
    if stale:
        print("stale: " + ", ".join(stale) + " (python docs/figures/render.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
