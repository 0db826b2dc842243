"""The one configuration object, and the parsing of human-readable sizes.

Pure code: no I/O. The CLI and the Python API both build a :class:`Config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from azcp_cluster.errors import UsageError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": KiB,
    "kib": KiB,
    "m": MiB,
    "mb": MiB,
    "mib": MiB,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
    "t": TiB,
    "tb": TiB,
    "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

COMPARE_MODES = ("none", "size", "etag", "md5")

# --auth: "auto" tries them in the documented order; any other forces that one.
AUTH_METHODS = (
    "auto",
    "sas",
    "connection-string",
    "key",
    "sas-token",
    "workload-identity",
    "managed-identity",
    "azure-cli",
    "anonymous",
)

# Rates: bits per second in decimal units as networks count them (Gbps, Gb/s), or bytes per
# second (MB/s decimal, MiB/s binary); a plain number is bytes per second.
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*?)(?:/s|ps)?\s*$")
_RATE_UNITS: dict[str, Fraction | int] = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": KiB,
    "MiB": MiB,
    "GiB": GiB,
    "TiB": TiB,
    "b": Fraction(1, 8),
    "Kb": Fraction(10**3, 8),
    "Mb": Fraction(10**6, 8),
    "Gb": Fraction(10**9, 8),
    "Tb": Fraction(10**12, 8),
}


def parse_rate(text: str) -> float:
    """Parse ``25Gbps``, ``25Gb/s``, ``800Mbps``, ``3GiB/s``, ``500MB/s`` or bytes/s into bytes per second.

    ``b`` is bits and ``B`` bytes, so the case of that letter matters; the prefix may be
    written ``k`` or ``K``. Raises :class:`UsageError` on anything else or on zero.
    """
    match = _RATE_RE.match(text)
    if not match:
        raise UsageError(f"invalid rate {text!r} (expected e.g. 25Gbps, 800Mb/s, 3GiB/s or bytes per second)")
    number, unit = match.groups()
    if unit[:1] == "k":
        unit = "K" + unit[1:]
    if text.strip().endswith("ps") and unit and unit[-1] == "B":
        raise UsageError(f"invalid rate {text!r}: 'ps' means bits per second, write e.g. 25Gbps or 3GB/s")
    factor = _RATE_UNITS.get(unit)
    if factor is None:
        raise UsageError(f"invalid rate unit in {text!r} (use bps, Kbps, Mbps, Gbps, B/s, MB/s, MiB/s, GiB/s)")
    value = Fraction(number) * factor
    if value <= 0:
        raise UsageError(f"rate {text!r} must be greater than zero")
    return float(value)


def parse_size(text: str) -> int:
    """Parse ``64MiB``, ``1GiB``, ``512M``, ``4k`` or plain bytes into a byte count.

    Units are binary (``M`` = ``MiB`` = 2**20), as in the reference tool. Raises
    :class:`UsageError` on anything else, including zero-free negatives.
    """
    match = _SIZE_RE.match(text)
    if not match:
        raise UsageError(f"invalid size {text!r} (expected e.g. 64MiB, 1GiB, 512M or a byte count)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise UsageError(f"invalid size unit in {text!r} (use B, KiB, MiB, GiB, TiB)")
    try:
        value = Fraction(number) * factor  # exact: a float loses bytes above 2**53 and overflows to inf
    except ValueError:  # more digits than int() converts
        raise UsageError(f"size {text!r} is too large") from None
    if value.denominator != 1:
        raise UsageError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_bytes(n: float) -> str:
    """Render a byte count for people, e.g. ``1.50 GiB``."""
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Config:
    """Everything one run needs to know; the same object on every rank."""

    source: str
    dest: str
    compare: str = "size"
    concurrency: int = 64
    block_size: int = 16 * MiB
    bcast_chunk: int = 64 * MiB
    bcast_pipeline: int = 4
    bcast_writers: int = 2
    bcast_direct: bool = True
    shard_size: int = 1 * GiB
    max_retries: int = 5
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    dry_run: bool = False
    verify: bool = False
    json_path: str | None = None
    progress: bool = True
    # A local SOURCE: the rank that reads it (default: the lowest rank that sees it).
    source_rank: int | None = None
    # How many ranks download (default all), chosen round-robin over the nodes.
    download_ranks: int | None = None
    # Cluster-wide download cap in bytes per second, split over the downloading ranks.
    max_bandwidth: float | None = None
    # Which credential: "auto" (first match wins) or one of AUTH_METHODS, forced.
    auth: str = "auto"
    # Seconds before a request that sends no bytes is abandoned and retried.
    read_timeout: float = 60.0
    connect_timeout: float = 30.0

    def validate(self) -> Config:
        """Check ranges and combinations; raise :class:`UsageError` naming the option."""
        if self.compare not in COMPARE_MODES:
            raise UsageError(f"--compare must be one of {', '.join(COMPARE_MODES)}, not {self.compare!r}")
        if self.auth not in AUTH_METHODS:
            raise UsageError(f"--auth must be one of {', '.join(AUTH_METHODS)}, not {self.auth!r}")
        positive = {
            "--concurrency": self.concurrency,
            "--block-size": self.block_size,
            "--bcast-chunk": self.bcast_chunk,
            "--shard-size": self.shard_size,
        }
        for name, value in positive.items():
            if value <= 0:
                raise UsageError(f"{name} must be greater than zero (got {value})")
        if not 1 <= self.bcast_pipeline <= 256:
            raise UsageError(f"--bcast-pipeline must be between 1 and 256 (got {self.bcast_pipeline})")
        if not 1 <= self.bcast_writers <= 64:
            raise UsageError(f"--bcast-writers must be between 1 and 64 (got {self.bcast_writers})")
        if self.source_rank is not None and self.source_rank < 0:
            raise UsageError(f"--source-rank must be zero or more (got {self.source_rank})")
        if self.download_ranks is not None and self.download_ranks < 1:
            raise UsageError(f"--download-ranks must be at least 1 (got {self.download_ranks})")
        if self.max_bandwidth is not None and self.max_bandwidth <= 0:
            raise UsageError(f"--max-bandwidth must be greater than zero (got {self.max_bandwidth})")
        if self.max_retries < 0:
            raise UsageError(f"--max-retries must be zero or more (got {self.max_retries})")
        if self.concurrency > 4096:
            raise UsageError(f"--concurrency {self.concurrency} is beyond the supported 4096")
        if self.read_timeout <= 0 or self.connect_timeout <= 0:
            raise UsageError("timeouts must be greater than zero")
        if not self.source:
            raise UsageError("SOURCE is empty")
        if not self.dest:
            raise UsageError("DEST is empty")
        return self

    def check_memory(self, available: int, download_pool: int) -> None:
        """Refuse settings whose buffers (slots plus ``download_pool``) cannot fit in ``available`` bytes."""
        need = self.bcast_pipeline * self.bcast_chunk + download_pool
        if need > available:
            raise UsageError(
                f"--bcast-pipeline {self.bcast_pipeline} x --bcast-chunk {format_bytes(self.bcast_chunk)} plus "
                f"download buffers need {format_bytes(need)} per rank, but only {format_bytes(available)} "
                "of memory is available; lower --bcast-chunk, --bcast-pipeline or --concurrency"
            )
